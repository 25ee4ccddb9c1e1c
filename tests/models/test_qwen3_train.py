"""Qwen3-MoE through the trainer: the shipped debug config trains on one process, and tensor parallelism
(experts replicated over TP, router and experts fed the whole sequence) trains the one-process model."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import REPO
from dist_harness import run_ranks
from torch.distributed.tensor import DTensor

pytestmark = pytest.mark.slow  # starts train.py and gloo worlds

CONFIG = str(REPO / "train_configs" / "qwen3_debug_moe.toml")


def test_shipped_debug_moe_config_trains_on_one_process(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("RANK", None)
    out = subprocess.run([sys.executable, str(REPO / "train.py"), "--job.config_file", CONFIG,
                          f"--job.dump_folder={tmp_path}", "--training.steps=20", "--metrics.enable_tensorboard=false"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Model qwen3 debugmodel_moe" in out.stderr
    losses = [float(x) for x in re.findall(r"step: \d+\s+loss: ([0-9.]+)", out.stderr)]
    assert len(losses) == 20
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3, losses


def _train(rank: int, world_size: int, dump: str, overrides: list[str]) -> dict:
    from torchtitan.config import ConfigManager
    from torchtitan.trainer import Trainer

    cfg = ConfigManager().parse_args(
        ["--job.config_file", CONFIG, f"--job.dump_folder={dump}", "--job.print_args=false",
         "--metrics.enable_tensorboard=false", "--metrics.log_freq=100", "--training.steps=3",
         "--training.deterministic", *overrides])
    trainer = Trainer(cfg)
    losses = trainer.train()
    replicated = {}
    for name, p in trainer.model_parts[0].named_parameters():
        if "router" in name or "experts" in name or "q_norm" in name:
            value = p.full_tensor() if isinstance(p, DTensor) else p
            replicated[name] = value.detach().clone()
    return {"losses": losses, "replicated": replicated}


@pytest.mark.parametrize("sp", [True, False])
def test_tp2_trains_the_one_process_moe_model(tmp_path, sp):
    one = run_ranks(_train, 1, str(tmp_path / "one"), [])[0]
    tp = ["--parallelism.tensor_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1",
          f"--parallelism.enable_sequence_parallel={'true' if sp else 'false'}"]
    outs = run_ranks(_train, 2, str(tmp_path / "tp"), tp, timeout=300)
    assert outs[0]["losses"] == pytest.approx(one["losses"], rel=1e-5)
    for name, value in outs[0]["replicated"].items():
        # The router, experts and query-norm weights stay equal on the TP ranks (their gradients agree there)
        # and equal to the one-process model's.
        assert torch.equal(value, outs[1]["replicated"][name]), name
        torch.testing.assert_close(value, one["replicated"][name], rtol=1e-4, atol=1e-5)
