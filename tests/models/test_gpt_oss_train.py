"""GPT-OSS through train.py under torchrun: a transformers GPT-OSS folder trains as ``--model.flavor DIR`` in a
sharded layout with transformers' step-1 loss, and the export script writes it back as transformers reads it."""

from __future__ import annotations

import re

import pytest
import torch
import transformers
from conftest import REPO, SHIPPED_TOKENIZER, load_script, run_torchrun

pytestmark = pytest.mark.slow  # starts train.py under torchrun

CONFIG = str(REPO / "train_configs" / "gpt_oss_debug.toml")
SEQ, BATCH = 32, 2


def test_transformers_folder_trains_with_their_step1_loss_under_ep2_and_exports_back(tmp_path, capsys):
    """EP 2 x FSDP 2 (each rank reads its experts' rows out of transformers' stacked, transposed, interleaved
    tensors), a window (6) shorter than the sequence: step-1 loss = transformers'; the export loads in
    transformers with the same logits."""
    from torchtitan.datasets import DataLayout, build_dataloader, build_tokenizer

    tokenizer = build_tokenizer(SHIPPED_TOKENIZER)
    config = transformers.GptOssConfig(
        vocab_size=tokenizer.n_words, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=6, swiglu_limit=1.0, max_position_embeddings=64, attn_implementation="eager")
    torch.manual_seed(0)
    theirs = transformers.GptOssForCausalLM(config).float().eval()
    with torch.no_grad():  # transformers starts biases and sinks at zero: draw them
        for name, p in theirs.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.copy_(0.5 * torch.randn_like(p))
    hf = tmp_path / "hf"
    theirs.save_pretrained(hf)
    loader = build_dataloader(dataset_name="embedded", dataset_path=None, tokenizer=tokenizer,
                              layout=DataLayout(SEQ, BATCH, 0, 1))
    inputs, labels = next(iter(loader))
    with torch.no_grad():
        want = float(torch.nn.functional.cross_entropy(theirs(inputs).logits.flatten(0, 1), labels.flatten()))

    dump = tmp_path / "dump"
    out = run_torchrun(
        REPO / "train.py", "--job.config_file", CONFIG, f"--job.dump_folder={dump}",
        "--parallelism.data_parallel_shard_degree=2", "--parallelism.expert_parallel_degree=2",
        f"--model.flavor={hf}", "--model.attn_mask_type=causal", "--metrics.enable_tensorboard=false",
        f"--training.seq_len={SEQ}", "--training.batch_size=1", "--training.steps=1", "--optimizer.lr=0",
        "--lr_scheduler.warmup_steps=0", "--checkpoint.enable_checkpoint", "--checkpoint.model_weights_only",
        f"--checkpoint.initial_load_path={hf}", "--checkpoint.initial_load_format=hf", timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    loss = float(re.search(r"step: 1 +loss: ([0-9.]+)", out.stderr).group(1))
    assert loss == pytest.approx(want, rel=1e-5, abs=1e-4)  # the log prints 5 significant digits
    # Once at start-up: the sinks skip FlexAttention here (no CUDA), and the experts' stacked weights (2 layers x 3
    # weights and 3 biases, on their own EP x FSDP mesh) take AdamW's fused kernel in one call with the rest.
    assert "kernel for the sinks and sliding windows: FlexAttention skipped, no CUDA device" in out.stderr
    assert re.search(r"AdamW: the fused kernel over \d+ tensors in 1 param group\(s\), the routed experts' 12 "
                     r"stacked weights among them", out.stderr), out.stderr[-3000:]

    exported = tmp_path / "exported"
    assert load_script("scripts/export_checkpoint.py").main(
        [str(dump / "checkpoint" / "step-1"), str(exported), "--format", "hf", "--dtype", "float32"]) == 0, \
        capsys.readouterr().err
    again = transformers.GptOssForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(inputs).logits, theirs(inputs).logits, rtol=1e-5, atol=1e-5)
