"""Crash safety and bad input: kill -9 mid-save, corrupt or mismatched checkpoints, keep_latest_k."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import REPO, run_torchrun
from dist_harness import run_ranks
from helpers import DEBUG, train

from torchtitan.config import ConfigError, ConfigManager
from torchtitan.models.llama3 import llama3_flavors

pytestmark = pytest.mark.slow  # every test here starts processes

HERE = Path(__file__).resolve().parent


def _torchrun(script: Path, dump: Path, *overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_torchrun(
        script, "--job.config_file", DEBUG, f"--job.dump_folder={dump}", "--job.print_args=false",
        "--metrics.enable_tensorboard=false", "--training.deterministic", "--checkpoint.enable_checkpoint",
        "--parallelism.data_parallel_shard_degree=2", *overrides, env={"OMP_NUM_THREADS": "1", **(env or {})})


def _step_lines(log: str) -> dict[int, str]:
    """Rank 0's 'step: N  loss: ...' lines by step, without the timestamp."""
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"\[rank0\].*INFO step: (\d+)  (loss: \S+)", log)}


def test_kill_9_during_save_leaves_previous_checkpoint_and_restart_skips_partial(tmp_path):
    run = ["--training.steps=6", "--checkpoint.interval=2", "--metrics.log_freq=1"]
    crashed = _torchrun(HERE / "crash_entry.py", tmp_path, *run, env={"CRASH_AT_STEP": "4"})
    assert crashed.returncode != 0
    folder = tmp_path / "checkpoint"
    assert sorted(p.name for p in folder.iterdir()) == ["step-2", "step-4.tmp"], crashed.stderr[-3000:]
    assert (folder / "step-2" / "checkpoint.json").is_file()
    assert not (folder / "step-4.tmp" / "checkpoint.json").exists()

    restarted = _torchrun(REPO / "train.py", tmp_path, *run)
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    log = restarted.stderr
    assert "skipping" in log and "step-4.tmp" in log
    assert re.search(r"loaded \S*step-2 ", log), log[-3000:]
    # The restart retrains steps 3 and 4 exactly as the crashed run did, then finishes.
    before, after = _step_lines(crashed.stderr), _step_lines(log)
    assert sorted(after) == [3, 4, 5, 6]
    assert after[3] == before[3] and after[4] == before[4]
    # Saving step 4 again replaced the leftover; every checkpoint is complete.
    assert sorted(p.name for p in folder.iterdir()) == ["step-2", "step-4", "step-6"]


# ---- corrupt, missing and mismatched checkpoints: preflight, no process group ----------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A dump folder holding complete checkpoints of steps 1 and 2 (one process)."""
    dump = tmp_path_factory.mktemp("saved")
    run_ranks(train, 1, str(dump), ["--training.steps=2", "--checkpoint.interval=1", "--training.deterministic",
                                    "--checkpoint.enable_checkpoint"])
    return dump


def _preflight(dump: Path, *overrides: str, world_size: int = 2) -> list[str]:
    from torchtitan.preflight import preflight

    cfg = ConfigManager().parse_args(["--job.config_file", DEBUG, f"--job.dump_folder={dump}",
                                      "--checkpoint.enable_checkpoint", *overrides])
    try:
        preflight(cfg, world_size)
    except ConfigError as e:
        return e.problems
    return []


def _snapshot(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*")}


def _copy(saved: Path, tmp_path: Path) -> Path:
    shutil.copytree(saved / "checkpoint", tmp_path / "checkpoint")
    return tmp_path


def test_intact_checkpoint_passes_preflight(saved, tmp_path):
    assert _preflight(_copy(saved, tmp_path)) == []


@pytest.mark.parametrize("damage, expected", [
    ("truncate", r"corrupt: data file __0_0\.distcp has \d+ bytes, \d+ were written"),
    ("metadata", r"corrupt: \.metadata is unreadable"),
    ("manifest", r"corrupt: it has no checkpoint\.json"),
])
def test_corrupt_latest_checkpoint_is_a_clear_error_and_nothing_is_deleted(saved, tmp_path, damage, expected):
    dump = _copy(saved, tmp_path)
    latest = dump / "checkpoint" / "step-2"
    if damage == "truncate":
        data = latest / "__0_0.distcp"
        data.write_bytes(data.read_bytes()[:1000])
    elif damage == "metadata":
        (latest / ".metadata").write_bytes(b"not a pickle")
    else:
        (latest / "checkpoint.json").unlink()
    before = _snapshot(dump)
    problems = _preflight(dump)
    assert problems, "a corrupt checkpoint must not load"
    assert re.search(expected, problems[0]) and str(latest) in problems[0], problems
    assert "nothing was deleted" in problems[-1] and "load_step" in problems[-1] and "1" in problems[-1]
    assert _snapshot(dump) == before
    # The older checkpoint is still there to be chosen explicitly.
    assert _preflight(dump, "--checkpoint.load_step=1") == []


def test_model_shape_mismatch_names_the_parameters(saved, tmp_path):
    dump = _copy(saved, tmp_path)
    problems = _preflight(dump, "--model.flavor=1B")
    text = "\n".join(problems)
    assert str(dump / "checkpoint" / "step-2") in problems[0]
    # The debug model against the 1B config, sizes from the flavor table.
    debug, big = llama3_flavors["debugmodel"], llama3_flavors["1B"]
    assert debug.n_layers < big.n_layers
    saved_wk = [debug.n_kv_heads * debug.dim // debug.n_heads, debug.dim]
    wanted_wk = [big.n_kv_heads * big.dim // big.n_heads, big.dim]
    assert f"shape differs: layers.0.attention.wk.weight is {saved_wk} in the checkpoint, {wanted_wk} in this " \
           "config;" in text
    assert "... and 52 more" in text  # long lists are cut, with a count
    first_lacking = min(f"layers.{i}.attention.wk.weight" for i in range(debug.n_layers, big.n_layers))  # by name
    assert f"parameters the checkpoint lacks: {first_lacking};" in text
    assert "parameters this model lacks" not in text
    # Not loading the model (e.g. to reuse only the data position) skips the comparison.
    assert _preflight(dump, "--model.flavor=1B", "--checkpoint.exclude_from_loading=model,optimizer") == []


def test_missing_or_incomplete_load_step(saved, tmp_path):
    dump = _copy(saved, tmp_path)
    problems = _preflight(dump, "--checkpoint.load_step=7")
    assert problems == [f"--checkpoint.load_step=7: there is no such checkpoint in {dump / 'checkpoint'} "
                        "(complete steps: 1, 2); use -1 for the latest complete one"]
    os.rename(dump / "checkpoint" / "step-2", dump / "checkpoint" / "step-2.tmp")
    problems = _preflight(dump, "--checkpoint.load_step=2")
    assert "only an incomplete save (step-2.tmp) exists" in problems[0]
    # The latest *complete* checkpoint is step 1 now: the default load skips the leftover.
    assert _preflight(dump) == []


def test_bad_checkpoint_options(saved, tmp_path):
    problems = _preflight(tmp_path, "--checkpoint.exclude_from_loading=model,optimiser", "--checkpoint.load_step=-3")
    assert any("unknown state(s) optimiser; choose from model, optimizer" in p for p in problems)
    assert any("--checkpoint.load_step=-3" in p for p in problems)
    problems = _preflight(tmp_path, "--checkpoint.create_seed_checkpoint")
    assert any("runs on one process, but WORLD_SIZE=2" in p for p in problems)
    problems = _preflight(_copy(saved, tmp_path), "--checkpoint.create_seed_checkpoint", world_size=1)
    assert any("already holds checkpoints (steps 1, 2)" in p for p in problems)


def test_corrupt_checkpoint_fails_every_rank_before_any_collective(saved, tmp_path):
    dump = _copy(saved, tmp_path)
    (dump / "checkpoint" / "step-2" / ".metadata").write_bytes(b"")
    out = _torchrun(REPO / "train.py", dump, "--training.steps=3")
    assert out.returncode != 0
    assert out.stderr.count("config error: checkpoint") >= 2, out.stderr[-3000:]  # one per rank
    assert "Training failed" not in out.stderr  # it stopped in preflight, not in training
    assert (dump / "checkpoint" / "step-2" / ".metadata").exists()


# ---- keep_latest_k ----------------------------------------------------------------------------
def test_keep_latest_k_keeps_the_loaded_checkpoint(tmp_path):
    common = ["--checkpoint.interval=1", "--training.deterministic", "--checkpoint.enable_checkpoint"]
    run_ranks(train, 1, str(tmp_path), [*common, "--training.steps=3", "--checkpoint.keep_latest_k=2"])
    folder = tmp_path / "checkpoint"
    assert sorted(p.name for p in folder.iterdir()) == ["step-2", "step-3"]
    # Resume from the older step 2 with k=1: step 2 is the one loaded, so it survives;
    # step 3 is saved again (replaced), then step 4 supersedes it.
    (result,) = run_ranks(train, 1, str(tmp_path), [*common, "--training.steps=4", "--checkpoint.keep_latest_k=1",
                                                    "--checkpoint.load_step=2"])
    assert result["step"] == 4 and len(result["losses"]) == 2
    assert sorted(p.name for p in folder.iterdir()) == ["step-2", "step-4"]
