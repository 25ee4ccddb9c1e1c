"""scripts/estimate_memory.py against the bytes the project's Trainer really allocates.

The fast tests run the real Trainer for one step inside a *fake* world (one process whose
collectives move nothing): every tensor a rank of that world holds is really allocated,
with the shapes the real layout gives, so the bytes can be counted and compared with the
estimate. ``benchmarks/footprint.py`` makes the same comparison on real 8-rank gloo runs;
the last test here does it on 2 real gloo ranks.
"""

from __future__ import annotations

import sys

import pytest
import torch.distributed as dist
from conftest import REPO

from torchtitan.config import ConfigManager

DEBUG = str(REPO / "train_configs" / "debug_model.toml")
for folder in ("scripts", "benchmarks"):
    if str(REPO / folder) not in sys.path:
        sys.path.insert(0, str(REPO / folder))

import estimate_memory  # noqa: E402
from common import state_bytes  # noqa: E402


def _config(dump: str, *overrides: str):
    return ConfigManager().parse_args(
        ["--job.config_file", DEBUG, f"--job.dump_folder={dump}", "--job.print_args=false",
         "--metrics.enable_tensorboard=false", "--training.steps=1", "--lr_scheduler.warmup_steps=0", *overrides])


def _estimate(dump: str, world: int, *overrides: str) -> estimate_memory.StateEstimate:
    try:
        est, _ = estimate_memory.estimate_state(_config(dump, *overrides), world)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return est


def _held_after_one_step(dump: str, *overrides: str) -> dict[str, int]:
    """Bytes rank 0 of the Trainer holds just before its first optimizer step (and after it)."""
    from torchtitan.trainer import Trainer

    trainer = Trainer(_config(dump, *overrides))
    held: dict[str, int] = {}
    # Gradients exist between backward and zero_grad: read everything just before the step.
    trainer.optimizer.register_step_pre_hook(
        lambda *_: held.update(state_bytes(trainer.model_parts, trainer.optimizer)))
    trainer.train()
    held["optimizer"] = state_bytes(trainer.model_parts, trainer.optimizer)["optimizer"]
    return held


@pytest.fixture
def fake_world(monkeypatch):
    """Rank 0 of a fake world: the Trainer finds the process group already there and joins it."""
    def join(world: int) -> None:
        for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world)}.items():
            monkeypatch.setenv(key, value)
        estimate_memory._join_fake_world(world)

    yield join
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("world, overrides", [
    (8, ["--parallelism.data_parallel_shard_degree=8"]),
    (8, ["--parallelism.data_parallel_replicate_degree=2", "--parallelism.data_parallel_shard_degree=4"]),
    (3, ["--parallelism.data_parallel_shard_degree=3"]),  # uneven: FSDP pads every shard to the largest
])
def test_estimate_equals_what_the_trainer_allocates(tmp_path, fake_world, world, overrides):
    est = _estimate(str(tmp_path), world, *overrides)
    fake_world(world)
    held = _held_after_one_step(str(tmp_path), *overrides)
    assert (est.params, est.grads, est.optimizer) == (held["params"], held["grads"], held["optimizer"])


@pytest.mark.parametrize("world, overrides, degree, replicated", [
    (8, ["--parallelism.data_parallel_shard_degree=8"], 8, 0),
    (8, ["--parallelism.data_parallel_replicate_degree=8", "--parallelism.data_parallel_shard_degree=1"], 1, 0),
    # TP without sequence parallelism leaves the 13 norm weights (256 each) whole on each TP
    # rank: FSDP 4 shards them, TP does not, so each rank holds them 4-way, not 8-way, sharded.
    (8, ["--parallelism.data_parallel_shard_degree=4", "--parallelism.tensor_parallel_degree=2",
         "--parallelism.enable_sequence_parallel=false"], 8, 13 * 256 // 4 - 13 * 256 // 8),
])
def test_state_is_divided_by_the_sharding_degree(tmp_path, world, overrides, degree, replicated):
    est = _estimate(str(tmp_path), world, *overrides)
    # The debug model's shapes divide evenly: 4 B per parameter / degree, no padding.
    assert est.params == est.grads == 4 * (est.param_numel_total // degree + replicated)
    n_tensors = (est.optimizer - 2 * est.params) // 4  # one float32 AdamW step counter per tensor
    assert 0 < n_tensors < 100


def test_pipeline_estimate_takes_the_heaviest_stage(tmp_path):
    est = _estimate(str(tmp_path), 2, "--parallelism.data_parallel_shard_degree=1",
                    "--parallelism.pipeline_parallel_degree=2", "--training.batch_size=2")
    # Two stages of three blocks each; one adds the embeddings, the other the norm and output.
    assert 0.5 * est.param_numel_total < est.local_param_numel < 0.6 * est.param_numel_total


def _real_rank(rank: int, world_size: int, dump: str) -> dict[str, int]:
    return _held_after_one_step(dump, f"--parallelism.data_parallel_shard_degree={world_size}")


def test_estimate_equals_real_gloo_ranks(tmp_path):
    from dist_harness import run_ranks

    measured = run_ranks(_real_rank, 2, str(tmp_path), timeout=900)
    est = _estimate(str(tmp_path), 2, "--parallelism.data_parallel_shard_degree=2")
    for key in ("params", "grads", "optimizer"):
        assert getattr(est, key) == max(m[key] for m in measured), key
