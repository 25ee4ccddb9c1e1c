"""The CPU peer comparison's own logic, without the peer installed: the learning-rate schedule it
gives the project matches the one it gives the peer at every step, the per-step medians
are read as documented (rank 0's wall, CPU summed over ranks, warm-up and last step left out), and
the project's side runs: its options parse and its instrumentation of the trainer records every step
and checks every batch (a one-process trainer here; the driver runs it under torchrun)."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks" / "peer"))
sys.path.insert(0, str(REPO / "benchmarks"))  # common.py, as the scripts find it
import peer_cpu  # noqa: E402
import peer_cpu_assets  # noqa: E402
import peer_cpu_compare  # noqa: E402

from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.distributed.lifecycle import shutdown_distributed  # noqa: E402
from torchtitan.optim.lr_scheduler import lr_factor, resolve_decay_steps  # noqa: E402


def _peer_factor(step: int, warmup_steps: int, total_steps: int, min_lr_factor: float, **_) -> float:
    """TorchTitan 0.3.0's LambdaLR factor at 1-based ``step`` for a linear decay with
    ``decay_ratio=None``: warm-up (k+1)/W, one stable step, then 1 - progress over T - W steps."""
    k, w, d = step - 1, warmup_steps, total_steps - warmup_steps
    if k < w:
        return (k + 1) / w
    if k < w + 1:
        return 1.0
    return min_lr_factor + (1 - min_lr_factor) * (1 - (k + 1 - (w + 1)) / d)


@pytest.mark.parametrize("warmup,total", [(2, 50), (2, 12), (2, 7), (3, 40)])
def test_project_schedule_equals_the_peer_schedule_at_every_step(warmup, total):
    peer = peer_cpu.peer_lr_schedule(warmup, total, 0.1)
    ratio = peer_cpu.project_decay_ratio(warmup, total)
    decay = resolve_decay_steps(total_steps=total, warmup_steps=warmup, decay_ratio=ratio)
    for step in range(1, total + 1):
        ours = lr_factor(step, warmup_steps=warmup, decay_steps=decay, total_steps=total,
                         decay_type="linear", lr_min=0.1)
        assert ours == pytest.approx(_peer_factor(step, **peer), rel=1e-12, abs=1e-15), step
    assert lr_factor(total, warmup_steps=warmup, decay_steps=decay, total_steps=total,
                     decay_type="linear", lr_min=0.1) == pytest.approx(0.1)


def _write_run(folder, side: str, walls: list[float], losses: list[float], lrs: list[float]) -> None:
    """Two ranks' step records as the workers write them: rank 1 has twice rank 0's page faults."""
    for rank in range(2):
        records = [{"wall": w, "cpu": 0.5 * i, "sys": 0.1 * i, "minflt": 100 * (rank + 1) * i, "loss": loss,
                    "grad_norm": 2.0 * loss, "lr": lr} for i, (w, loss, lr) in enumerate(zip(walls, losses, lrs))]
        (folder / f"{side}_rank{rank}.json").write_text(json.dumps(records))


def test_read_run_takes_rank0_wall_and_cpu_summed_over_ranks(tmp_path):
    # 5 steps + the end stamp; rank 0's steps take 1, 2, 3, 4, 9 s of wall, each rank 0.5 s of CPU
    # (0.1 s of it in the kernel) and 100 page faults per step, rank 1 twice the faults.
    _write_run(tmp_path, "project", [0, 1, 3, 6, 10, 19], [5.0 - i for i in range(6)], [1e-3] * 6)
    run = peer_cpu_compare.read_run(tmp_path, "project", ranks=2, warmup=1)
    assert run["steps_timed"] == 3  # steps 2..4: the warm-up step and the last one are left out
    assert run["wall"] == 3.0
    assert run["cpu"] == 1.0
    assert run["sys"] == pytest.approx(0.2) and run["minflt"] == 300
    assert [r["loss"] for r in run["trace"]] == [5.0, 4.0, 3.0, 2.0, 1.0]


def test_compare_traces_reports_the_largest_gap_of_the_two_sides(tmp_path):
    # The peer's losses are the project's except step 3 (4 % apart) and step 5 (1 % apart); its
    # learning rate differs at step 2 only (by half). Each gap is relative to the peer's value.
    walls = [0, 1, 2, 3, 4, 5]
    project_loss = [5.0, 4.0, 3.0, 2.0, 1.0, 1.0]
    peer_loss = [5.0, 4.0, 3.0 / 1.04, 2.0, 1.0 / 1.01, 1.0]
    _write_run(tmp_path, "project", walls, project_loss, [1e-3] * 6)
    _write_run(tmp_path, "peer", walls, peer_loss, [1e-3, 2e-3, 1e-3, 1e-3, 1e-3, 1e-3])
    project = peer_cpu_compare.read_run(tmp_path, "project", ranks=2, warmup=1)["trace"]
    peer = peer_cpu_compare.read_run(tmp_path, "peer", ranks=2, warmup=1)["trace"]
    gaps = peer_cpu_compare.compare_traces(project, peer)
    assert gaps["loss_rel"] == pytest.approx(0.04)
    assert gaps["grad_norm_rel"] == pytest.approx(0.04)  # grad norms are twice the losses on both sides
    assert gaps["lr_rel"] == pytest.approx(0.5)
    assert gaps["loss_at"] == {1: (5.0, 5.0)}  # steps 10 and 50 are past the end of a 5-step trace
    # Order matters (the peer is the reference), and identical traces have no gap.
    assert peer_cpu_compare.compare_traces(peer, project)["lr_rel"] == pytest.approx(1.0)
    assert peer_cpu_compare.compare_traces(peer, peer)["loss_rel"] == 0.0


def test_the_project_side_options_parse(tmp_path):
    overrides = peer_cpu_compare.project_overrides(tmp_path, batch=1, seq=64, steps=12)
    cfg = ConfigManager().parse_args(["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"),
                                      *overrides])
    assert cfg.training.dataset_path == str(tmp_path / "store") and cfg.checkpoint.initial_load_format == "hf"


def test_the_project_side_records_each_step_and_checks_its_batch(tmp_path, trainer_factory, shipped_tokenizer):
    # Issue 60: the worker wrapped a trainer method whose argument had gone (TypeError at the first step), and
    # nothing ran it. Here the trainer's loader gives step 1 the window dumped for it; step 2's is altered.
    windows = peer_cpu_assets.loader_windows(shipped_tokenizer, None, ranks=1, batch=1, seq=64, steps=2)
    windows[1, 0, 0, 0] += 1
    trainer = trainer_factory(tmp_path, "--training.steps=2", "--lr_scheduler.warmup_steps=0")
    records = peer_cpu_compare.instrument(trainer, windows)
    try:
        with pytest.raises(AssertionError, match="step 2: the project's loader and the dumped windows disagree"):
            trainer.train()
    finally:  # the trainer's one-rank group lives in this pytest process: end it as train.py does
        shutdown_distributed(ok=False, timeout_seconds=60)
    first = records[0]
    assert first["lr"] == pytest.approx(8e-4 * 0.55) and first["loss"] > 0 and first["grad_norm"] > 0, first
    assert {"wall", "cpu", "sys", "minflt"} <= set(first) and len(records) == 2 and "loss" not in records[1]
