"""Generation from checkpoints of short training runs, through ``scripts/generate.py``.

An FSDP run's checkpoint generates the same greedy tokens on one process (DCP reshards it) and under
``torchrun`` with tensor parallelism over 2 ranks; a tokenizer that does not fit the checkpoint's
vocabulary is refused in one line. A DeepSeek-V3 MoE trained with the routing bias moving generates,
from its checkpoint, what transformers generates from the exported Hugging Face folder: the bias is read
with the weights on every path (``checkpoint/formats.load_into``), never reset after.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, SHIPPED_TOKENIZER, load_script, make_trainer, torchrun_env

from torchtitan.datasets.tokenizer import build_tokenizer

pytestmark = pytest.mark.slow  # starts torchrun

DEBUG_TOML = str(REPO / "train_configs" / "debug_model.toml")
PROMPTS = ["Once upon a time", "The little dog"]


def _torchrun(*argv: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = torchrun_env(OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           *argv], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """The dump folder of a 2-step FSDP 2 run of the debug model that saved its last step."""
    dump = tmp_path_factory.mktemp("generate_run")
    out = _torchrun(str(REPO / "train.py"), "--job.config_file", DEBUG_TOML, f"--job.dump_folder={dump}",
                    "--metrics.enable_tensorboard=false", "--training.seq_len=32", "--training.steps=2",
                    "--parallelism.data_parallel_shard_degree=2", "--checkpoint.enable_checkpoint")
    assert out.returncode == 0, out.stderr[-3000:]
    assert (dump / "checkpoint" / "step-2" / ".metadata").is_file() and (dump / "config.toml").is_file()
    return dump


def _script():
    spec = importlib.util.spec_from_file_location("generate_script", REPO / "scripts" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _small_hf_tokenizer(folder: Path) -> Path:
    """A Hugging Face tokenizer of 6 words: not the vocabulary the run trained with."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir()
    tok = Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "<unk>": 2, "the": 3, "dog": 4, "a": 5}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return folder


def test_one_process_and_tp2_generate_the_same_from_an_fsdp_checkpoint(trained, tmp_path, capsys) -> None:
    prompt_args = [a for p in PROMPTS for a in ("--prompt", p)]
    # One process: the checkpoint folder (its latest step), the run's config.toml found above it.
    assert _script().main([str(trained / "checkpoint"), *prompt_args, "--max_new_tokens", "8", "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert alone["tensor_parallel"] == 1 and alone["dtype"] == "float32"
    eos = build_tokenizer(SHIPPED_TOKENIZER).eos_id  # the run's tokenizer
    assert all(len(o["tokens"]) == 8 or o["tokens"][-1] == eos for o in alone["outputs"])
    out = _torchrun(str(REPO / "scripts" / "generate.py"), str(trained / "checkpoint" / "step-2"), *prompt_args,
                    "--max_new_tokens", "8", "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    (line,) = out.stdout.splitlines()  # rank 0 prints, once
    tp = json.loads(line)
    assert tp["tensor_parallel"] == 2
    for a, b in zip(alone["outputs"], tp["outputs"]):
        assert (a["prompt_tokens"], a["tokens"], a["text"]) == (b["prompt_tokens"], b["tokens"], b["text"])

    # A tokenizer whose vocabulary is not the checkpoint's.
    small = _small_hf_tokenizer(tmp_path / "small_tok")
    assert _script().main([str(trained / "checkpoint"), "--prompt", "the dog", "--tokenizer", str(small)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "(6 tokens) does not match the vocabulary of" in err, err


def _generate_json(path: Path, capsys, max_new_tokens: int = 8) -> list[dict]:  # noqa: ANN001 - pytest's capsys
    argv = [str(path), *[a for p in PROMPTS for a in ("--prompt", p)], "--max_new_tokens", str(max_new_tokens),
            "--json"]
    assert _script().main(argv) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)["outputs"]


def _train_moe_with_routing_bias(dump: Path) -> Path:
    """The checkpoint of 2 steps of the DeepSeek-V3 debug model, in this process, the routing bias moving fast
    (``--moe.load_balance_coeff=1``: its update is the coefficient times a sign)."""
    import logging

    from torchtitan.distributed.lifecycle import shutdown_distributed

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level  # the trainer installs its own; pytest's come back after
    config = str(REPO / "train_configs" / "deepseek_v3_debug.toml")
    trainer = make_trainer(dump, "--training.steps=2", "--training.seq_len=32", "--moe.load_balance_coeff=1.0",
                           "--checkpoint.enable_checkpoint", "--checkpoint.interval=2",
                           "--checkpoint.model_weights_only", config=config)
    trainer.train()
    trainer.close()
    shutdown_distributed(ok=True, timeout_seconds=60)  # its one-rank group lives in this pytest process
    root.handlers[:], root.level = handlers, level
    return dump / "checkpoint" / "step-2"


def test_a_moe_trained_with_the_routing_bias_generates_as_transformers_does_from_its_export(tmp_path, capsys) -> None:
    """From the checkpoint, scripts/generate.py gives transformers' greedy tokens of the exported folder, whose
    e_score_correction_bias is the trained bias; the script on the export gives them too, and AutoTokenizer reads
    the export's tokenizer (the run's SentencePiece model, converted). The logits agree where dropping the bias
    moves them 100 times more than the tolerance, so a reset bias cannot pass unseen."""
    import torch
    import transformers
    from safetensors.torch import load_file
    from test_generate import hf_greedy

    from torchtitan.generation import describe, load

    checkpoint = _train_moe_with_routing_bias(tmp_path / "dump")
    ours = _generate_json(checkpoint.parent, capsys)
    export = load_script("scripts/export_checkpoint.py").main
    exported = tmp_path / "hf"
    assert export([str(checkpoint), str(exported), "--format", "hf", "--dtype", "float32"]) == 0, capsys.readouterr()
    capsys.readouterr()
    hf = {k: v for f in exported.glob("*.safetensors") for k, v in load_file(f).items()}
    biases = {k: v for k, v in hf.items() if k.endswith("mlp.gate.e_score_correction_bias")}
    assert len(biases) == 3 and any(bool(b.abs().max() > 0.1) for b in biases.values()), biases  # 3 MoE layers
    prompt_tokens = [o["prompt_tokens"] for o in ours]
    theirs = hf_greedy(exported, prompt_tokens, 8, transformers.DeepseekV3ForCausalLM)
    eos = build_tokenizer(SHIPPED_TOKENIZER).eos_id
    for row, want in zip([o["tokens"] for o in ours], theirs):
        assert row == want[:len(row)] and (len(row) == 8 or row[-1] == eos), (row, want)
    from_export = _generate_json(exported, capsys)
    assert [(o["prompt_tokens"], o["tokens"]) for o in from_export] == [(o["prompt_tokens"], o["tokens"]) for o in ours]
    assert transformers.AutoTokenizer.from_pretrained(exported)(PROMPTS[0])["input_ids"] == prompt_tokens[0]

    model = load(describe(checkpoint), device=torch.device("cpu")).model
    reference = transformers.DeepseekV3ForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    tokens = torch.tensor([prompt_tokens[0]])
    with torch.no_grad():
        got, want = model(tokens), reference(tokens).logits
        for bias in biases:
            reference.get_buffer(bias).zero_()
        unbiased = reference(tokens).logits
    tolerance = 1e-5 * want.abs().max().item()
    assert (got - want).abs().max().item() <= tolerance
    assert (unbiased - want).abs().max().item() > 100 * tolerance
