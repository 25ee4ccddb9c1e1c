"""A start in step, and quiet logs: two runs side by side (torchrun and plain processes, real lighthouses).

``late_run`` (torchrun, FSDP 2 per group): group 1 starts 5 s after group 0, with
``min_replicas`` 1 at the lighthouse and in the groups. Group 0's first step waits for group
1 (``startup_timeout_seconds`` 60), so both groups log step 1 and every step, and each loss
equals that of plain HSDP 2x2 (one 4-rank torchrun job, run meanwhile) with the same global batch: step 1
bitwise, later steps within 1e-5 (the cross-group gradient average rounds differently from HSDP's).

``alone_run`` (one rank per group, plain processes): group 0 starts with a 2 s startup
timeout; group 1 never comes within it. Group 0 commits step 1 alone right after the timeout
and logs the missing group; group 1, started once group 0 has trained two steps (group 0 then
waits for it to begin, so that it finds group 0 still training), heals from it on its first step
and is bitwise the survivor from then on (the heal of a late group is unchanged).

Neither the HSDP run nor any group prints FSDP2's view-tensor warning, torchft's
flight-recorder line (every quorum) or the not-writable-buffer warning (the heal).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import torchrun_command
from test_ft_runs import COMMON, ENTRY, _by_step, _env, _lighthouse, _records, _wait, stop

pytestmark = pytest.mark.slow  # every test here starts processes

LATE_STEPS, LATE_S = 3, 5.0
ALONE_STEPS, ALONE_TIMEOUT = 6, 2
NOISE = ("returned a view tensor", "Unable to reset NCCL flight recorder recording", "The given buffer is not writable",
         "'set_vital' is deprecated")
RUN = [*COMMON, "--lr_scheduler.warmup_steps=1"]


def _ft(replica_id: int, address: str, timeout: int) -> list[str]:
    return ["--fault_tolerance.enable", f"--fault_tolerance.replica_id={replica_id}",
            "--fault_tolerance.num_replica_groups=2", "--fault_tolerance.min_replicas=1",
            f"--fault_tolerance.lighthouse={address}", f"--fault_tolerance.startup_timeout_seconds={timeout}",
            "--fault_tolerance.timeout_seconds=10", "--comm.train_timeout_seconds=30"]


def _torchrun(tmp: Path, name: str, nproc: int, args: list[str]) -> subprocess.Popen:
    cmd = torchrun_command(ENTRY, *RUN, f"--training.steps={LATE_STEPS}", f"--job.dump_folder={tmp / name}", *args,
                           nproc=nproc)
    return subprocess.Popen(cmd, env=_env(tmp / name), stdout=open(tmp / f"{name}.log", "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def _alone_group(tmp: Path, g: int, address: str, timeout: int, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, ENTRY, *RUN, f"--training.steps={ALONE_STEPS}", f"--job.dump_folder={tmp / f'g{g}'}",
         *_ft(g, address, timeout)],
        env=_env(tmp / f"g{g}", **env), stdout=open(tmp / f"g{g}.log", "w"), stderr=subprocess.STDOUT,
        start_new_session=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both runs at once (each with a lighthouse of its own), to keep CI short."""
    late, alone = tmp_path_factory.mktemp("ft_late"), tmp_path_factory.mktemp("ft_alone")
    late_lighthouse, late_address = _lighthouse(late, min_replicas=1)
    alone_lighthouse, alone_address = _lighthouse(alone, min_replicas=1)
    fsdp = ["--parallelism.data_parallel_shard_degree=2"]
    began = time.monotonic()
    late_procs = {"g0": _torchrun(late, "g0", 2, [*fsdp, *_ft(0, late_address, 60)]),
                  "hsdp": _torchrun(late, "hsdp", 4, ["--parallelism.data_parallel_replicate_degree=2", *fsdp])}
    # Group 0 waits after its step 2 until group 1 begins its first step, and sleeps 1 s after each step it
    # trains alone: group 1's first quorum finds it still training. Group 1's own wait is long: it must join.
    ready = alone / "g1_ready"
    alone_procs = {"g0": _alone_group(alone, 0, alone_address, ALONE_TIMEOUT, FT_THROTTLE_ALONE="1",
                                      FT_PAUSE_AFTER_STEP=f"2:{ready}")}
    try:
        while ("g1" not in late_procs or "g1" not in alone_procs) and time.monotonic() < began + 120:
            if "g1" not in late_procs and time.monotonic() >= began + LATE_S:
                late_procs["g1"] = _torchrun(late, "g1", 2, [*fsdp, *_ft(1, late_address, 60)])
            if "g1" not in alone_procs and (len(_records(alone / "g0.0")) >= 2 or alone_procs["g0"].poll() is not None):
                alone_procs["g1"] = _alone_group(alone, 1, alone_address, 60, FT_MARK_FIRST_STEP=str(ready))
            time.sleep(0.1)
        late_codes = _wait(late_procs, late, timeout=180)
        alone_codes = _wait(alone_procs, alone, timeout=60)
    finally:
        stop(late_lighthouse, late_procs)
        stop(alone_lighthouse, alone_procs)
    late_records = {(name, rank): _records(late / f"{name}.{rank}") for name in ("g0", "g1") for rank in (0, 1)}
    late_records["hsdp", 0] = _records(late / "hsdp.0")
    logs = {folder: {name: (folder / f"{name}.log").read_text() for name in procs}
            for folder, procs in ((late, late_procs), (alone, alone_procs))}
    return ((late_codes, late_records, logs[late]),
            (alone_codes, {g: _records(alone / f"{g}.0") for g in ("g0", "g1")}, logs[alone]))


@pytest.fixture(scope="module")
def late_run(runs):
    return runs[0]


@pytest.fixture(scope="module")
def alone_run(runs):
    return runs[1]


def test_a_late_group_trains_step_one_and_every_loss_equals_hsdp(late_run):
    codes, records, logs = late_run
    assert codes == {"g0": 0, "hsdp": 0, "g1": 0}, (codes, logs["g0"][-3000:], logs["g1"][-3000:])
    hsdp = [r["loss"] for r in records["hsdp", 0]]
    assert len(hsdp) == LATE_STEPS
    for (name, rank), recs in records.items():
        if name == "hsdp":
            continue
        assert [r["step"] for r in recs] == list(range(1, LATE_STEPS + 1)), (name, rank, recs)
        assert all(r["participants"] == 2 and r["heals"] == 0 for r in recs), (name, rank, recs)
        losses = [r["loss"] for r in recs]
        assert losses == [r["loss"] for r in records["g0", 0]], (name, rank, "the groups log different losses")
        # Step 1 runs on the same weights: its loss is bitwise HSDP's. Later steps differ by the rounding of the
        # gradient reduction (in-group average, then across groups, against HSDP's), as in test_ft_runs.py.
        assert losses[0] == hsdp[0], (name, rank, losses, hsdp)
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, hsdp)), (name, rank, losses, hsdp)
    # Group 0 did wait for group 1 (which began about 5 s later), not train step 1 on its own.
    first = {g: _by_step(records[g, 0])[1] for g in ("g0", "g1")}
    assert first["g0"]["time"] - first["g0"]["began"] >= LATE_S / 2, first
    assert "all 2 replica groups joined" in logs["g0"]


def test_a_group_that_never_comes_costs_the_startup_timeout_only(alone_run):
    codes, records, logs = alone_run
    assert codes == {"g0": 0, "g1": 0}, (codes, logs["g0"][-3000:], logs["g1"][-3000:])
    g0 = records["g0"]
    assert [r["step"] for r in g0] == list(range(1, ALONE_STEPS + 1))
    waited = g0[0]["time"] - g0[0]["began"]
    assert ALONE_TIMEOUT <= waited <= ALONE_TIMEOUT + 15, f"step 1 took {waited:.1f} s (timeout {ALONE_TIMEOUT} s)"
    assert g0[0]["participants"] == 1
    assert ("starting with replica group(s) [0] of 2 after waiting" in logs["g0"]
            and "missing: group(s) [1]" in logs["g0"])


def test_a_group_that_comes_later_heals_as_before(alone_run):
    _, records, _ = alone_run
    g1, survivor = records["g1"], _by_step(records["g0"])
    assert g1 and g1[0]["heals"] == 1 and g1[0]["step"] > 2, g1[:1]
    assert g1[-1]["step"] == ALONE_STEPS
    for r in g1:
        assert r["state"] == survivor[r["step"]]["state"] and r["loss"] == survivor[r["step"]]["loss"], r["step"]


def test_no_alarming_lines(late_run, alone_run):
    logs = {**{f"late {k}": v for k, v in late_run[2].items()}, **{f"alone {k}": v for k, v in alone_run[2].items()}}
    assert "healed from a live peer" in logs["alone g1"]  # the heal ran, so its warning had its chance
    for name, text in logs.items():
        for line in NOISE:
            assert line not in text, f"{name}: {line!r}\n{text[-3000:]}"
