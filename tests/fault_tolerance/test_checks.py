"""The [fault_tolerance] checks preflight runs: one line each, naming the option and the fix."""

from __future__ import annotations

import pytest
from conftest import CI_CONFIG, debug_config

from torchtitan.config import ConfigError, ConfigManager, JobConfig
from torchtitan.datasets.partition import data_slot
from torchtitan.distributed import ParallelDims
from torchtitan.fault_tolerance.checks import check_fault_tolerance
from torchtitan.preflight import preflight

CI = CI_CONFIG
FT = ["--fault_tolerance.enable", "--fault_tolerance.num_replica_groups=2",
      "--fault_tolerance.lighthouse=http://localhost:29510"]


def _problems(world_size: int, *overrides: str) -> list[str]:
    cfg = debug_config(*FT, *overrides, config=CI)
    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    return _check(cfg, dims)


def _check(cfg: JobConfig, dims: ParallelDims) -> list[str]:
    return check_fault_tolerance(cfg.fault_tolerance, dims, comm=cfg.comm, training=cfg.training,
                                 checkpoint=cfg.checkpoint, optimizer=cfg.optimizer)


def test_a_sound_group_passes_and_disabled_checks_nothing(monkeypatch):
    assert _problems(2) == []
    cfg = debug_config("--parallelism.data_parallel_replicate_degree=2", config=CI)
    assert _check(cfg, ParallelDims.from_config(cfg.parallelism, 2)) == []
    # The lighthouse may come from the environment instead.
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://localhost:29510")
    cfg = debug_config("--fault_tolerance.enable", config=CI)
    assert _check(cfg, ParallelDims.from_config(cfg.parallelism, 1)) == []


@pytest.mark.parametrize(
    "world, overrides, needle",
    [
        (2, ["--fault_tolerance.replica_id=2"], "replica_id=2 is out of range: give 0 <= replica_id < "),
        (2, ["--fault_tolerance.min_replicas=3"], "min_replicas=3 exceeds num_replica_groups=2"),
        (4, ["--parallelism.data_parallel_replicate_degree=2"], "needs --parallelism.data_parallel_replicate_degree=1"),
        (2, ["--parallelism.pipeline_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1"],
         "does not support pipeline parallelism"),
        (2, ["--comm.train_timeout_seconds=20"], "timeouts out of order"),
        (2, ["--fault_tolerance.timeout_seconds=5", "--comm.train_timeout_seconds=400"], "timeouts out of order"),
        (2, ["--fault_tolerance.semi_sync_method=diloco", "--fault_tolerance.sync_steps=4",
             "--fault_tolerance.num_fragments=2", "--fault_tolerance.fragment_sync_delay=2"],
         "fragment_sync_delay=2 must be below sync_steps / num_fragments (2)"),
        (2, ["--fault_tolerance.semi_sync_method=diloco", "--fault_tolerance.fragment_update_alpha=1.5"],
         "fragment_update_alpha=1.5 must be in [0, 1]"),
        (2, ["--fault_tolerance.semi_sync_method=local_sgd", "--fault_tolerance.num_fragments=2"],
         "num_fragments and fragment_sync_delay apply to diloco only"),
        (2, ["--checkpoint.create_seed_checkpoint"], "write the seed checkpoint with a plain run"),
        (2, ["--training.dataset=c4"], "needs a token store: --training.dataset=c4 is streamed"),
        (2, ["--optimizer.name=MuonClip"], "enable with --optimizer.name=MuonClip: QK-clip takes each head's"),
    ],
)
def test_each_problem_names_its_fix(world, overrides, needle):
    problems = _problems(world, *overrides)
    assert len(problems) == 1 and needle in problems[0], problems


@pytest.mark.parametrize("method", ["none", "diloco"])
def test_muon_is_accepted_under_fault_tolerance(method):
    """Muon's state heals like AdamW's and its owners are a group's own ranks (test_ft_runs.py, test_diloco_run.py)."""
    from torchtitan.preflight import check_config

    cfg = debug_config(*FT, "--optimizer.name=Muon", f"--fault_tolerance.semi_sync_method={method}", config=CI)
    assert check_config(cfg) == [] and _check(cfg, ParallelDims.from_config(cfg.parallelism, 2)) == []


def test_diloco_fragments_must_divide_sync_steps():
    (line,) = _problems(2, "--fault_tolerance.semi_sync_method=diloco", "--fault_tolerance.sync_steps=5",
                        "--fault_tolerance.num_fragments=2")
    assert "sync_steps=5 is not divisible by num_fragments=2" in line and "give a multiple" in line
    # Raised by preflight on every rank before any process group exists.
    cfg = ConfigManager().parse_args(["--job.config_file", CI, *FT, "--fault_tolerance.semi_sync_method=diloco",
                                      "--fault_tolerance.sync_steps=5", "--fault_tolerance.num_fragments=2"])
    with pytest.raises(ConfigError) as info:
        preflight(cfg, 1)
    assert any("sync_steps=5 is not divisible by num_fragments=2" in p for p in info.value.problems)


@pytest.mark.parametrize("method", ["diloco", "local_sgd"])
def test_semi_sync_methods_pass(method):
    extra = ["--fault_tolerance.num_fragments=2"] if method == "diloco" else []
    assert _problems(2, f"--fault_tolerance.semi_sync_method={method}", "--fault_tolerance.sync_steps=4",
                     *extra) == []


def test_missing_lighthouse_and_seed(monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    cfg = debug_config("--fault_tolerance.enable", config=CI)
    cfg.training.seed = None
    problems = _check(cfg, ParallelDims.from_config(cfg.parallelism, 1))
    assert any("needs a lighthouse" in p and "torchft_lighthouse" in p for p in problems), problems
    assert any("needs --training.seed" in p and "different weights" in p for p in problems), problems


def test_missing_torchft_says_how_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name, *a))
    (line,) = _problems(2)
    assert "needs torchft" in line and "pip install torchft" in line


def test_preflight_reports_ft_problems_and_counts_every_group_in_the_global_batch():
    cfg = debug_config(*FT, "--fault_tolerance.replica_id=5", config=CI)
    with pytest.raises(ConfigError) as info:
        preflight(cfg, 1)
    assert any("replica_id=5 is out of range" in p for p in info.value.problems)
    # 2 groups x 1 rank x batch 1: a global batch of 4 means 2 micro-steps per step.
    cfg = debug_config(*FT, "--training.global_batch_size=4", config=CI)
    assert preflight(cfg, 1).grad_accum == 2
    cfg = debug_config(*FT, "--training.global_batch_size=3", config=CI)
    with pytest.raises(ConfigError, match="data-parallel degree \\(2\\)"):
        preflight(cfg, 1)


def test_data_slots_of_the_groups_tile_the_global_batch():
    slots = [data_slot(g, 3, r, 2) for g in range(3) for r in range(2)]
    assert slots == [(i, 6) for i in range(6)]
