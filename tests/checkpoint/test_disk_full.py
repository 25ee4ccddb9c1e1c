"""A full disk during a checkpoint save: named in one line on every rank, nothing partial left, exit status 74.

The checkpoint folder lives on a small tmpfs that the test mounts and unmounts; where
the machine refuses mounts, ``disk_full_entry.py`` emulates the same small disk (its
free space and ENOSPC on writes past it). Every run goes through torchrun and train.py.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from checkpoint.test_crash_safety import _step_lines, _torchrun

from torchtitan.checkpoint import integrity, space

HERE = Path(__file__).resolve().parent
ENTRY = HERE / "disk_full_entry.py"
MB = 1 << 20
# The debug model's full checkpoint on 2 ranks is about 71 MB (weights and Adam's two moments).
ONE_CHECKPOINT_FITS = 110 * MB
NOTHING_FITS = 20 * MB


@contextlib.contextmanager
def small_disk(where: Path, size: int):
    """(folder, env): a tmpfs of ``size`` bytes mounted at ``where``, or the emulation's env where mounts fail."""
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                             capture_output=True, check=False).returncode == 0
    try:
        yield where, ({} if mounted else {"SMALL_DISK_BYTES": str(size)})
    finally:
        if mounted:
            subprocess.run(["umount", str(where)], check=True)


def _full_disk_lines(log: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"\[rank(\d)\].* ERROR (checkpoint: disk full: .*)", log)}


RUN = ["--training.steps=2", "--checkpoint.interval=1", "--metrics.log_freq=1"]


@pytest.mark.slow
def test_a_first_save_that_does_not_fit_is_named_and_writes_nothing(tmp_path):
    with small_disk(tmp_path / "disk", NOTHING_FITS) as (dump, env):
        out = _torchrun(ENTRY, dump, *RUN, env=env)
        folder = dump / "checkpoint"
        lines = _full_disk_lines(out.stderr)
        assert sorted(lines) == [0, 1], out.stderr[-3000:]  # one line on every rank
        assert lines[0] == lines[1]
        assert re.fullmatch(rf"checkpoint: disk full: the save of step 1 does not fit; nothing was written \(needs "
                            rf"[\d,]+ bytes in {folder}, [\d,]+ are free\); last good checkpoint: none\. .*", lines[0])
        needed, free = (int(x.replace(",", "")) for x in re.findall(r"([\d,]+) (?:bytes in|are free)", lines[0]))
        assert 60 * MB < needed < 80 * MB and free <= NOTHING_FITS
        # torchrun names the first rank to exit as the root cause: status 74 (the other may be stopped by it).
        assert re.search(r"exitcode\s*: 74", out.stderr) and out.returncode != 0
        # One line, no traceback from a rank (torchrun's own report follows the lines).
        assert "Training failed" not in out.stderr and not re.search(r"^\[rank\d\]:", out.stderr, re.MULTILINE)
        assert "cannot hold one more checkpoint" in out.stderr  # the warning at start
        assert not folder.exists() or list(folder.iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_a_later_save_that_fills_the_disk_keeps_the_earlier_checkpoint_bitwise(tmp_path, async_mode):
    """Async: step 4's save fails in the background; every rank names it at the step-6 save, none alone at step 5
    (``SKEWED_ASYNC``: rank 0 sees the failure between steps, rank 1 does not)."""
    good, failed, steps = (1, 2, 2) if async_mode == "disabled" else (2, 4, 6)
    run = [f"--training.steps={steps}", f"--checkpoint.interval={good}", "--metrics.log_freq=1",
           f"--checkpoint.async_mode={async_mode}"]
    with small_disk(tmp_path / "disk", ONE_CHECKPOINT_FITS) as (dump, env):
        # The check before the save is fooled (UNDERESTIMATE): the second save starts and meets ENOSPC midway.
        out = _torchrun(ENTRY, dump, *run, env={**env, "UNDERESTIMATE": "1", "SKEWED_ASYNC": "1"})
        folder = dump / "checkpoint"
        lines = _full_disk_lines(out.stderr)
        assert sorted(lines) == [0, 1], out.stderr[-3000:]
        assert lines[0] == lines[1]
        assert lines[0].startswith(f"checkpoint: disk full: the save of step {failed} filled the disk while writing; "
                                   f"its partial folder was removed (needs 1 bytes in {folder}, ")
        assert f"last good checkpoint: {folder / f'step-{good}'}." in lines[0]
        assert re.search(r"exitcode\s*: 74", out.stderr)
        assert sorted(p.name for p in folder.iterdir()) == [f"step-{good}"]  # the partial folder removed
        kept = folder / f"step-{good}"
        manifest = json.loads((kept / "checkpoint.json").read_text())
        # Every byte of the kept checkpoint is as it was written (its checksums were taken while writing).
        assert integrity.bad_files(kept, manifest["checksums"], set(manifest["checksums"]["files"])) == []
        if async_mode == "async":
            assert steps in _step_lines(out.stderr)  # the failure waited for the next save, where every rank is
            return
        shutil.copytree(kept, tmp_path / "restart" / "checkpoint" / "step-1")

    # The earlier checkpoint resumes: step 2 trains exactly as in the run that filled the disk.
    restarted = _torchrun(Path(__file__).parents[2] / "train.py", tmp_path / "restart", *run)
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert re.search(r"loaded \S*step-1 ", restarted.stderr)
    assert "written without checksums" not in restarted.stderr and "corrupt" not in restarted.stderr
    assert _step_lines(restarted.stderr)[2] == _step_lines(out.stderr)[2]


@pytest.mark.slow
def test_the_check_before_a_save_uses_the_previous_checkpoints_size(tmp_path):
    """A later save that does not fit stops before writing: the size of the step before decides."""
    with small_disk(tmp_path / "disk", ONE_CHECKPOINT_FITS) as (dump, env):
        out = _torchrun(ENTRY, dump, *RUN, env=env)
        folder = dump / "checkpoint"
        lines = _full_disk_lines(out.stderr)
        assert sorted(lines) == [0, 1] and lines[0] == lines[1], out.stderr[-3000:]
        step1 = space.checkpoint_bytes(folder / "step-1")
        assert lines[0].startswith(f"checkpoint: disk full: the save of step 2 does not fit; nothing was written "
                                   f"(needs {step1:,} bytes in {folder}, ")
        assert sorted(p.name for p in folder.iterdir()) == ["step-1"]


def test_the_start_warning_counts_keep_latest_k_plus_one(tmp_path, monkeypatch):
    """Room = free space + the checkpoints already there (deleted as new ones commit); k kept + 1 being written."""
    folder = tmp_path / "checkpoint"
    (folder / "step-1").mkdir(parents=True)
    (folder / "step-1" / "checkpoint.json").write_text(json.dumps({"format": 1, "kind": "full", "files": {"a": 100}}))
    monkeypatch.setattr(space, "free_bytes", lambda _: 150)
    assert space.room_warning(folder, 2, 100) == (
        f"checkpoint: {folder} cannot hold keep_latest_k + 1 = 3 checkpoints of about 100 bytes each: 300 bytes are "
        "needed, 250 are available; a save will fail with a full disk")
    assert space.room_warning(folder, 1, 100) is None
    assert space.room_warning(folder, 0, 100) is None  # keep all: one more must fit in the free space
    assert "cannot hold one more checkpoint (keep_latest_k=0 keeps them all)" in space.room_warning(folder, 0, 151)
