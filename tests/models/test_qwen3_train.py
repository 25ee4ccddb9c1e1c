"""Qwen3-MoE through the trainer: the shipped debug config trains on one process, with its MoE metrics; tensor
parallelism (experts replicated over TP, router and experts fed the whole sequence) trains the one-process model
and keeps the router equal on the TP ranks; a Hugging Face folder goes in and comes back out."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import REPO, torchrun_env
from dist_harness import run_ranks
from torch.distributed.tensor import DTensor

pytestmark = pytest.mark.slow  # starts train.py and gloo worlds

CONFIG = str(REPO / "train_configs" / "qwen3_debug_moe.toml")


def test_shipped_debug_moe_config_trains_on_one_process(tmp_path):
    env = torchrun_env()  # no RANK, MASTER_PORT...: a plain one-process run makes its own store
    out = subprocess.run([sys.executable, str(REPO / "train.py"), "--job.config_file", CONFIG,
                          f"--job.dump_folder={tmp_path}", "--training.steps=20", "--moe.aux_loss=switch",
                          "--metrics.log_freq=2"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Model qwen3 debugmodel_moe" in out.stderr
    losses = [float(x) for x in re.findall(r"step: \d+\s+loss: ([0-9.]+)", out.stderr)]
    assert len(losses) == 10
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses
    # The MoE metrics: on the step line, and in TensorBoard, summed over the window's two steps.
    moe = re.findall(r"moe: imbalance ([0-9.]+) \(max ([0-9.]+)\) aux ([0-9.]+) tokens/expert", out.stderr)
    assert len(moe) == 10 and all(1 <= float(mean) <= float(peak) for mean, peak, _ in moe), moe
    assert all(0.9 < float(aux) < 3 for _, _, aux in moe), moe  # Switch's E * sum f P: 1 when balanced
    scalars = _tensorboard_scalars(tmp_path / "tb")
    per_step = 1 * 64 * 2 * 3  # batch x seq x top_k x the 3 sparse layers: (token, slot) pairs
    tokens = [scalars[f"moe/tokens_per_expert/{e}"] for e in range(8)]
    assert all(sum(step) == 2 * per_step for step in zip(*tokens)), tokens
    assert len(scalars["moe/imbalance"]) == 10 and scalars["moe/imbalance_max"][0] >= scalars["moe/imbalance"][0]


def _tensorboard_scalars(folder) -> dict[str, list[float]]:  # noqa: ANN001
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = {p.parent for p in folder.rglob("events.out.tfevents.*")}
    acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _train(rank: int, world_size: int, dump: str, overrides: list[str]) -> dict:
    from torchtitan.config import ConfigManager
    from torchtitan.trainer import Trainer

    cfg = ConfigManager().parse_args(
        ["--job.config_file", CONFIG, f"--job.dump_folder={dump}", "--job.print_args=false",
         "--metrics.enable_tensorboard=false", "--metrics.log_freq=100", "--training.steps=3",
         "--training.deterministic", "--training.batch_size=2", *overrides])
    trainer = Trainer(cfg)
    losses = trainer.train()
    replicated = {}
    for name, p in trainer.model_parts[0].named_parameters():
        if "router" in name or "experts" in name or "q_norm" in name:
            value = p.full_tensor() if isinstance(p, DTensor) else p
            replicated[name] = value.detach().clone()
    return {"losses": losses, "replicated": replicated}


# Pipeline and expert-parallel layouts are trained against one process in tests/distributed/test_moe_layouts.py.
LAYOUTS = {
    "tp2_sp": ["--parallelism.tensor_parallel_degree=2", "--parallelism.enable_sequence_parallel=true"],
    "tp2": ["--parallelism.tensor_parallel_degree=2", "--parallelism.enable_sequence_parallel=false"],
}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    return run_ranks(_train, 1, str(tmp_path_factory.mktemp("one")), [])[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_rank_layouts_train_the_one_process_moe_model(tmp_path, layout, one_process):
    one = one_process
    outs = run_ranks(_train, 2, str(tmp_path / "two"), ["--parallelism.data_parallel_shard_degree=1",
                                                        *LAYOUTS[layout]], timeout=300)
    assert outs[0]["losses"] == pytest.approx(one["losses"], rel=1e-5)
    for name, value in outs[0]["replicated"].items():
        # The router, experts and query-norm weights stay equal on the TP ranks (their gradients agree there)
        # and equal to the one-process model's.
        assert torch.equal(value, outs[1]["replicated"][name]), name
        torch.testing.assert_close(value, one["replicated"][name], rtol=1e-4, atol=1e-5)


def test_train_from_a_qwen3_moe_folder_then_export_loads_in_transformers(tmp_path):
    """train.py under torchrun, FSDP 2 (each rank reads its experts' rows) from a Qwen3-MoE Hugging Face folder:
    step-1 loss = transformers'; then the export script writes back the same tensors, which transformers loads."""
    import json

    import transformers
    from conftest import SHIPPED_TOKENIZER, load_script
    from safetensors.torch import load_file

    from torchtitan.datasets import DataLayout, build_dataloader, build_tokenizer

    tokenizer = build_tokenizer(SHIPPED_TOKENIZER)
    config = transformers.Qwen3MoeConfig(
        vocab_size=tokenizer.n_words, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=2, mlp_only_layers=[0], norm_topk_prob=True, max_position_embeddings=64)
    torch.manual_seed(0)
    theirs = transformers.Qwen3MoeForCausalLM(config).float().eval()
    hf = tmp_path / "hf"
    theirs.save_pretrained(hf)
    loader = build_dataloader(dataset_name="embedded", dataset_path=None, tokenizer=tokenizer,
                              layout=DataLayout(32, 2, 0, 1))
    inputs, labels = next(iter(loader))
    with torch.no_grad():
        want = float(torch.nn.functional.cross_entropy(theirs(inputs).logits.flatten(0, 1), labels.flatten()))

    dump = tmp_path / "dump"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(REPO / "train.py"),
         "--job.config_file", CONFIG, f"--job.dump_folder={dump}", "--parallelism.data_parallel_shard_degree=2",
         f"--model.flavor={hf}", "--model.attn_mask_type=causal", "--metrics.enable_tensorboard=false",
         "--training.seq_len=32", "--training.batch_size=1", "--training.steps=1", "--optimizer.lr=0",
         "--lr_scheduler.warmup_steps=0", "--checkpoint.enable_checkpoint", "--checkpoint.model_weights_only",
         f"--checkpoint.initial_load_path={hf}", "--checkpoint.initial_load_format=hf"],
        capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    loss = float(re.search(r"step: 1 +loss: ([0-9.]+)", out.stderr).group(1))
    assert loss == pytest.approx(want, abs=1e-4)  # the log prints 5 significant digits

    exported = tmp_path / "exported"
    assert load_script("scripts/export_checkpoint.py").main(
        [str(dump / "checkpoint" / "step-1"), str(exported), "--format", "hf", "--dtype", "float32"]) == 0
    assert json.loads((exported / "config.json").read_text())["architectures"] == ["Qwen3MoeForCausalLM"]
    original = load_file(hf / "model.safetensors")
    back = {k: v for f in exported.glob("*.safetensors") for k, v in load_file(f).items()}
    assert back.keys() == original.keys()
    for name, t in original.items():
        assert torch.equal(back[name], t), name
    again, info = transformers.Qwen3MoeForCausalLM.from_pretrained(exported, dtype=torch.float32,
                                                                   output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        torch.testing.assert_close(again.eval()(inputs).logits, theirs(inputs).logits, rtol=0, atol=0)


def _initial_weights(rank: int, world_size: int, dump: str, overrides: list[str]) -> dict:
    from torchtitan.config import ConfigManager
    from torchtitan.trainer import Trainer

    cfg = ConfigManager().parse_args(["--job.config_file", CONFIG, f"--job.dump_folder={dump}",
                                      "--job.print_args=false", "--metrics.enable_tensorboard=false", *overrides])
    model = Trainer(cfg).model_parts[0]
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters()}


def test_fsdp2_starts_from_the_one_process_weights_stacked_experts_included(tmp_path):
    """Layout-invariant init: each FSDP rank draws its rows of [E, F, D], and the whole is one process's."""
    one = run_ranks(_initial_weights, 1, str(tmp_path / "one"), [])[0]
    two = run_ranks(_initial_weights, 2, str(tmp_path / "two"), ["--parallelism.data_parallel_shard_degree=2"])[0]
    assert two.keys() == one.keys() and any(".experts.w1" in k for k in one)
    for name, value in one.items():
        assert torch.equal(two[name], value), name
