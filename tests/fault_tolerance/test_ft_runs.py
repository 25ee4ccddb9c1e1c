"""Fault-tolerant HSDP end to end: replica groups as real processes, and a lighthouse.

Four runs, each answering several questions, to keep CI short. The main one (two groups,
FSDP 2 each, under torchrun) trains Muon (AdamW for the non-matrix parameters); the other three AdamW:

- group 0 trains all the way (the survivor); group 1's rank 1 SIGKILLs itself right after
  step 8 (torchrun stops rank 0) and torchrun (``--max-restarts 1``) starts it again: the stale-key path, since
  torchrun's store still holds the dead manager's address (the restarted rank 0 creates its
  manager 1 s late, so rank 1 would read that address if it were not deleted);
- the survivor keeps training alone, discarding at most one step, and its step during the
  crash takes at most the heartbeat timeout + 2 s longer than a healthy one;
- the restarted group heals from the survivor on its first step (during the LR warmup), before
  any step of its own: it takes Muon's momentum buffers and AdamW's moments into the state created
  at start-up, and from then on its weights, optimizer state and learning rate are bitwise the
  survivor's and it logs the same loss;
- while both groups are healthy (steps 1-8) the loss equals a single process training
  the same global batch (4 sequences x 2 micro-batches), within 1e-5 relative: each matrix is
  orthogonalized from the gradient averaged over the groups, by its owner among the group's
  dp_shard ranks (the float32 iteration, so that the comparison is tight);
- with gradient accumulation a step takes one cross-group all-reduce per FSDP unit, not
  one per micro-batch (plus the token count, the loss and the replica check); Muon's owner
  traffic stays inside the group;
- the replica check runs every step (and passes, also right after the heal).

A second, shorter run has TP 2 inside each group (no data parallelism in a group, where
FSDP would otherwise not be applied and no hook installed): the groups stay bitwise equal
and match one process training their global batch. At its last step one weight of group 1
is nudged, and the replica check stops both groups, naming the step.

A checkpoint run (one rank per group): the two groups save at steps 3 and 6, each
checkpoint written by one group only, and a plain process with their global batch trains
the same losses (1e-5); from the groups' step 3, a whole-job restart retrains steps 4-6
bitwise as before, and a plain process resumes with the same losses (1e-5); from the plain
process's step 3, two groups resume with the same losses (1e-5).

A last run (one rank per group; group 1 under torchrun) loses its lighthouse for 5 s mid-run
(with ``quorum_retries`` both groups wait and carry on); then every process of group 1 is
SIGKILLed (its worker, then its torchrun agent) and the group is started again by hand, and
heals on its first step.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import CI_CONFIG, torchrun_command, torchrun_env

from torchtitan.distributed.lifecycle import free_port

pytestmark = pytest.mark.slow  # every test here starts processes

ENTRY = str(Path(__file__).with_name("ft_entry.py"))
CONFIG = CI_CONFIG
STEPS, CRASH_AT = 20, 8  # eight healthy steps compared with one process, then the crash
HEARTBEAT_MS = 1000
ACCUM = 2
WARMUP = 16  # the restarted group heals during the warmup, while the learning rate changes fastest
COMMON = [f"--job.config_file={CONFIG}", f"--training.steps={STEPS}", f"--lr_scheduler.warmup_steps={WARMUP}",
          "--metrics.log_freq=1",
          "--metrics.enable_tensorboard=false", "--training.batch_size=1",
          f"--training.gradient_accumulation_steps={ACCUM}"]
FSDP_UNITS = 7  # the debug model's 6 blocks and the root
GRADS_AT = 1  # the step whose reduced gradients each group's rank 0 and the one process save (ft_entry.py)
TP_STEPS = 4
SKIPPED_STEP = 2  # the TP run's step with a non-finite gradient in group 1 (and the reference)
MUON = ("--optimizer.name=Muon", "--optimizer.muon_ns_dtype=float32")  # the main run's optimizer


def _env(record: Path, **extra: str) -> dict[str, str]:
    """This process' environment without torchrun's variables (an in-process trainer of an earlier test leaves
    RANK, MASTER_PORT, ...: one-rank groups would share that port), the repository first on the path."""
    defaults = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "FT_RECORD": str(record),
                "FT_PIDS": str(record.parent / "pids")}
    return torchrun_env(**{**defaults, **extra})  # a caller's FT_PIDS (group 1 of the outage run) wins


def _group(tmp: Path, replica_id: int, lighthouse: str, env: dict[str, str], restarts: int,
           layout: tuple[str, ...] = ("--parallelism.data_parallel_shard_degree=2", *MUON)) -> subprocess.Popen:
    cmd = torchrun_command(
        ENTRY, *COMMON, f"--job.dump_folder={tmp / f'g{replica_id}'}",
        *layout, "--fault_tolerance.enable",
        f"--fault_tolerance.replica_id={replica_id}", "--fault_tolerance.num_replica_groups=2",
        "--fault_tolerance.replica_check_freq=1",
        f"--fault_tolerance.lighthouse={lighthouse}", "--fault_tolerance.timeout_seconds=10",
        "--fault_tolerance.quorum_timeout_seconds=60", "--comm.train_timeout_seconds=30",
        launch=[f"--max-restarts={restarts}"])
    return subprocess.Popen(cmd, env=env, stdout=open(tmp / f"g{replica_id}.log", "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait(procs: dict[str, subprocess.Popen], tmp: Path, timeout: float) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    codes = {}
    try:
        for name, p in procs.items():
            codes[name] = p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        logs = "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(tmp.glob("*.log")))
        pytest.fail(f"fault-tolerance run did not finish in {timeout:.0f} s\n{logs}")
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        _kill_pids(tmp / "pids")  # workers left behind by a killed torchrun agent
    return codes


def stop(lighthouse: subprocess.Popen, procs: dict[str, subprocess.Popen]) -> None:
    """Stop the lighthouse and every process still running, each with its whole session."""
    lighthouse.kill()
    lighthouse.wait()
    for p in procs.values():
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)


def _kill_pids(folder: Path) -> None:
    """SIGKILL every process whose pid ``ft_entry.py`` recorded in ``folder`` (gone ones are skipped)."""
    for pid in folder.iterdir():
        try:
            os.kill(int(pid.name), signal.SIGKILL)
        except ProcessLookupError:
            pass


def _start_lighthouse(tmp: Path, min_replicas: int, port: int, join_timeout_ms: int = 1000,
                      heartbeat_ms: int = HEARTBEAT_MS) -> subprocess.Popen:
    return subprocess.Popen(
        ["torchft_lighthouse", f"--min_replicas={min_replicas}", f"--bind=[::]:{port}",
         f"--heartbeat_timeout_ms={heartbeat_ms}", f"--join_timeout_ms={join_timeout_ms}", "--quorum_tick_ms=50"],
        stdout=open(tmp / "lighthouse.log", "a"), stderr=subprocess.STDOUT, start_new_session=True)


def _lighthouse(tmp: Path, min_replicas: int) -> tuple[subprocess.Popen, str]:
    # torchft is a dependency of the project: its absence fails these tests, it does not skip them.
    assert shutil.which("torchft_lighthouse"), "torchft_lighthouse not found: bash scripts/install.sh installs torchft"
    port = free_port()
    lighthouse = _start_lighthouse(tmp, min_replicas, port)
    (tmp / "pids").mkdir()
    return lighthouse, f"http://localhost:{port}"


@pytest.fixture(scope="module")
def ft_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ft")
    lighthouse, address = _lighthouse(tmp, min_replicas=1)
    (tmp / "start").mkdir()
    together = {"FT_START_TOGETHER": f"{tmp / 'start'}:4", "FT_DUMP_GRADS_AT_STEP": str(GRADS_AT)}
    try:
        procs = {
            "g0": _group(tmp, 0, address, _env(tmp / "g0", FT_THROTTLE_ALONE="2", **together), restarts=0),
            "g1": _group(tmp, 1, address, _env(tmp / "g1", FT_CRASH_AT_STEP=str(CRASH_AT), FT_SLOW_RESTARTED_RANK0="1",
                                                     **together), restarts=1),
            # The same global batch (4 sequences x 2 micro-batches), one process, no fault tolerance.
            "ref": subprocess.Popen(
                [sys.executable, ENTRY, *COMMON, *MUON, "--training.batch_size=4",
                 f"--job.dump_folder={tmp / 'ref'}"], env=_env(tmp / "ref", FT_DUMP_GRADS_AT_STEP=str(GRADS_AT)),
                stdout=open(tmp / "ref.log", "w"), stderr=subprocess.STDOUT, start_new_session=True),
        }
        codes = _wait(procs, tmp, timeout=200)
    finally:
        lighthouse.kill()
        lighthouse.wait()
    records = {name: {rank: _records(tmp / f"{name}.{rank}") for rank in (0, 1)} for name in ("g0", "g1")}
    return tmp, codes, records, _records(tmp / "ref.0")


def _by_step(records: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in records}


def test_both_groups_finish(ft_run):
    tmp, codes, records, _ = ft_run
    assert codes == {"g0": 0, "g1": 0, "ref": 0}, (codes, (tmp / "g1.log").read_text()[-3000:])
    for rank in (0, 1):
        assert [r["step"] for r in records["g0"][rank]] == list(range(1, STEPS + 1)), "survivor skipped or redid a step"
        assert records["g1"][rank][-1]["step"] == STEPS
    for name in ("g0", "g1", "ref"):  # build_muon's line: the groups' matrices have owners, one process has none
        expected = "orthogonalized here" if name == "ref" else "each orthogonalized by one owner rank"
        assert expected in (tmp / f"{name}.log").read_text(), f"{name} did not train Muon"


def test_survivor_trains_alone_and_loses_at_most_one_step(ft_run):
    _, _, records, _ = ft_run
    survivor = records["g0"][0]
    alone = [r["step"] for r in survivor if r["participants"] == 1]
    assert alone and min(alone) > CRASH_AT, f"survivor never trained alone after the crash: {survivor}"
    assert survivor[-1]["discarded"] <= 1, f"survivor discarded {survivor[-1]['discarded']} steps"
    by_step = _by_step(survivor)
    duration = {step: r["time"] - r["began"] for step, r in by_step.items()}
    healthy = statistics.median(duration[step] for step in range(2, CRASH_AT + 1))
    stall = duration[CRASH_AT + 1] - healthy
    # The dead group is noticed by the failed all-reduce or the lighthouse's heartbeat timeout.
    assert stall <= HEARTBEAT_MS / 1000 + 2, (f"survivor stalled {stall:.1f} s after the crash "
                                              f"(healthy step {healthy:.1f} s)")


def test_rejoined_group_heals_and_matches_survivor_bitwise(ft_run):
    _, _, records, _ = ft_run
    for rank in (0, 1):
        before = [r for r in records["g1"][rank] if r["restart"] == "0"]
        after = [r for r in records["g1"][rank] if r["restart"] == "1"]
        assert [r["step"] for r in before] == list(range(1, CRASH_AT + 1))
        assert after, "the restarted group committed no step"
        assert after[0]["heals"] == 1 and after[0]["step"] > CRASH_AT + 1, after[0]
        assert after[0]["step"] <= WARMUP, f"healed at step {after[0]['step']}, after the warmup"
        survivor = _by_step(records["g0"][rank])
        for r in after:
            s = survivor[r["step"]]
            assert r["state"] == s["state"], f"rank {rank} step {r['step']}: weights/Muon state differ from survivor"
            assert r["loss"] == s["loss"], f"rank {rank} step {r['step']}: loss {r['loss']} != {s['loss']}"


def test_healthy_groups_match_one_process_with_the_same_global_batch(ft_run):
    _, _, records, ref = ft_run
    assert [r["step"] for r in ref] == list(range(1, STEPS + 1))
    for step in range(1, CRASH_AT + 1):
        losses = {(g, rank): _by_step(records[g][rank])[step]["loss"] for g in ("g0", "g1") for rank in (0, 1)}
        assert len(set(losses.values())) == 1, f"step {step}: groups log different losses {losses}"
        assert _by_step(records["g0"][0])[step]["participants"] == 2
        expected = ref[step - 1]["loss"]
        assert abs(losses["g0", 0] - expected) <= 1e-5 * abs(expected), (step, losses["g0", 0], expected)


def test_cross_group_gradient_is_the_one_process_gradient(ft_run):
    """The gradient each group holds after the in-group and cross-group reductions (before clipping) is the
    gradient of one process training the global batch: equal losses alone do not show it, since Adam's step
    hardly changes when every gradient is off by one factor (a loss scale missing the group count)."""
    tmp = ft_run[0]
    g0, g1, ref = (torch.load(tmp / f"{name}.0.grads.pt", weights_only=True) for name in ("g0", "g1", "ref"))
    assert set(g0) == set(g1) == set(ref) and ref
    for fqn, expected in ref.items():
        assert torch.equal(g0[fqn], g1[fqn]), f"{fqn}: the groups hold different gradients"
        error = float((g0[fqn] - expected).norm() / expected.norm())
        assert error <= 1e-5, f"{fqn}: gradient {error:.2e} (relative) from one process's"


def test_one_cross_group_all_reduce_per_unit_per_step(ft_run):
    _, _, records, _ = ft_run
    for rank in (0, 1):
        counts = {r["allreduces"] for r in records["g0"][rank] if r["discarded"] == 0}
        # One per unit, plus the token count, the loss and the replica check (every step here).
        assert counts == {FSDP_UNITS + 3}, f"torchft all-reduces per step with {ACCUM} micro-batches: {counts}"


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    """Two healthy groups of TP 2 (no data parallelism inside a group) and one process with their global batch."""
    tmp = tmp_path_factory.mktemp("ft_tp")
    # A quorum needs both groups: neither trains a step alone while the other starts up.
    lighthouse, address = _lighthouse(tmp, min_replicas=2)
    tp = ("--parallelism.tensor_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1",
          "--fault_tolerance.min_replicas=2", f"--training.steps={TP_STEPS}", "--lr_scheduler.warmup_steps=1",
          "--stability.skip_nonfinite_steps", f"--debug.inject_nonfinite_grad={SKIPPED_STEP}")
    # Every group (and the reference) gets a non-finite gradient at SKIPPED_STEP, as an overflow in the
    # backward reaches every group through the cross-group average (the injection comes after it).
    try:
        procs = {"g0": _group(tmp, 0, address, _env(tmp / "g0"), restarts=0, layout=tp),
                 "g1": _group(tmp, 1, address, _env(tmp / "g1", FT_CORRUPT_AT_STEP=str(TP_STEPS)), restarts=0,
                              layout=tp)}
        procs["ref"] = subprocess.Popen(
            [sys.executable, ENTRY, *COMMON, "--training.batch_size=2", f"--training.steps={TP_STEPS}",
             "--lr_scheduler.warmup_steps=1", "--stability.skip_nonfinite_steps",
             f"--debug.inject_nonfinite_grad={SKIPPED_STEP}",
             f"--job.dump_folder={tmp / 'ref'}"], env=_env(tmp / "ref"), stdout=open(tmp / "ref.log", "w"),
            stderr=subprocess.STDOUT, start_new_session=True)
        codes = _wait(procs, tmp, timeout=120)
    finally:
        lighthouse.kill()
        lighthouse.wait()
    logs = {g: (tmp / f"{g}.log").read_text() for g in ("g0", "g1")}
    return codes, logs, {name: _records(tmp / f"{name}.0") for name in ("g0", "g1", "ref")}


def test_tp_groups_stay_equal_and_match_one_process(tp_run):
    """Without FSDP a TP-only group would install no hook and the groups would drift apart silently."""
    codes, _, records = tp_run
    g0, g1, ref = records["g0"], records["g1"], records["ref"]
    assert codes["ref"] == 0 and len(ref) == TP_STEPS
    assert [r["step"] for r in g0] == [r["step"] for r in g1] == list(range(1, TP_STEPS))
    for a, b, r in zip(g0, g1, ref):
        assert a["state"] == b["state"] and a["loss"] == b["loss"], f"step {a['step']}: the TP groups differ"
        assert abs(a["loss"] - r["loss"]) <= 1e-5 * abs(r["loss"]), (a["step"], a["loss"], r["loss"])


def test_fault_tolerant_groups_skip_a_non_finite_step(tp_run):
    """A non-finite gradient at SKIPPED_STEP: both groups (and one process) skip that step, so the weights and
    Adam state after it are bitwise those after the step before, and training goes on in step."""
    _, logs, records = tp_run
    for name in ("g0", "g1"):
        states = {r["step"]: r["weights_and_moments"] for r in records[name]}
        assert states[SKIPPED_STEP] == states[SKIPPED_STEP - 1], f"{name} applied the non-finite step"
        assert states[SKIPPED_STEP + 1] != states[SKIPPED_STEP], f"{name} stopped training after the skip"
        assert "skipped: 1" in logs[name], logs[name][-3000:]  # the step line counts it
    ref = {r["step"]: r["weights_and_moments"] for r in records["ref"]}
    assert ref[SKIPPED_STEP] == ref[SKIPPED_STEP - 1]


def test_replica_check_stops_both_groups_on_a_corrupted_weight(tp_run):
    codes, logs, _ = tp_run
    assert codes["g0"] != 0 and codes["g1"] != 0, codes
    for g in ("g0", "g1"):
        assert f"replica check failed at step {TP_STEPS}" in logs[g], logs[g][-3000:]


OUTAGE_STEPS, OUTAGE_AT, OUTAGE_S, KILL_AT = 24, 5, 5.0, 10


def _wait_for_step(record: Path, step: int, deadline: float) -> None:
    """Until ``record`` holds ``step`` steps; fails the test at ``deadline`` (the outage would miss the run)."""
    while len(_records(record)) < step:
        if time.monotonic() >= deadline:
            log = record.parent / f"{record.name.split('.')[0]}.log"
            pytest.fail(f"{record.name} reached step {len(_records(record))}, not {step}, by the deadline\n"
                        f"{log.read_text()[-3000:] if log.exists() else ''}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def outage_run(tmp_path_factory):
    """Two one-rank groups (group 0 plain ``python``, group 1 under torchrun): the lighthouse is down for
    5 s after step 5, then every process of group 1 is SIGKILLed after step 10 (its worker, then its
    agent) and the group is started again by hand."""
    tmp = tmp_path_factory.mktemp("ft_outage")
    lighthouse, address = _lighthouse(tmp, min_replicas=1)
    port = int(address.rsplit(":", 1)[1])
    (tmp / "start").mkdir()
    (tmp / "pids_g1").mkdir()  # group 1's workers, which torchrun starts in sessions of their own
    args = [*COMMON, f"--training.steps={OUTAGE_STEPS}", "--fault_tolerance.enable",
            "--fault_tolerance.num_replica_groups=2", f"--fault_tolerance.lighthouse={address}",
            "--fault_tolerance.quorum_retries=5", "--comm.train_timeout_seconds=60"]

    def launch(g: int, **env: str) -> subprocess.Popen:
        runner = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"] if g == 1
                  else [sys.executable])
        return subprocess.Popen(
            [*runner, ENTRY, *args, f"--fault_tolerance.replica_id={g}", f"--job.dump_folder={tmp / f'g{g}'}"],
            env=_env(tmp / f"g{g}", FT_START_TOGETHER=f"{tmp / 'start'}:2", **env),
            stdout=open(tmp / f"g{g}.log", "a"), stderr=subprocess.STDOUT, start_new_session=True)

    procs = {"g0": launch(0, FT_THROTTLE_ALONE="1"), "g1": launch(1, FT_PIDS=str(tmp / "pids_g1"))}
    try:
        deadline = time.monotonic() + 120
        _wait_for_step(tmp / "g0.0", OUTAGE_AT, deadline)
        lighthouse.kill()
        lighthouse.wait()
        down = time.time()
        time.sleep(OUTAGE_S)
        # A fresh lighthouse knows nobody, and the groups' heartbeats come back irregularly: with short
        # timeouts the first group to ask forms a quorum alone and the two live groups train apart
        # (docs/fault_tolerance.md, "Start the lighthouse"). Its timeouts: 5 s heartbeat, 10 s join.
        lighthouse = _start_lighthouse(tmp, 1, port, join_timeout_ms=10_000, heartbeat_ms=5_000)
        _wait_for_step(tmp / "g1.0", KILL_AT, deadline)
        _kill_pids(tmp / "pids_g1")  # the worker first, then its agent (which would otherwise restart it)
        os.killpg(procs["g1"].pid, signal.SIGKILL)
        assert procs["g1"].wait() == -signal.SIGKILL
        procs["g1"] = launch(1, FT_PIDS=str(tmp / "pids_g1"))
        codes = _wait(procs, tmp, timeout=120)
    finally:
        stop(lighthouse, procs)
        _kill_pids(tmp / "pids_g1")
    return codes, down, {g: _records(tmp / f"{g}.0") for g in ("g0", "g1")}


def test_both_groups_survive_a_lighthouse_outage(outage_run):
    codes, down, records = outage_run
    assert codes == {"g0": 0, "g1": 0}, codes
    assert [r["step"] for r in records["g0"]] == list(range(1, OUTAGE_STEPS + 1))
    first_life = [r for r in records["g1"] if r["pid"] == records["g1"][0]["pid"]]
    assert [r["step"] for r in first_life][:KILL_AT] == list(range(1, KILL_AT + 1))
    # The outage fell inside the run: steps were still taken after the lighthouse came back.
    assert any(r["time"] > down + OUTAGE_S for r in first_life), "group 1 was killed before the outage ended"
    survivor = _by_step(records["g0"])
    assert all(r["state"] == survivor[r["step"]]["state"] for r in first_life)


def test_a_killed_and_relaunched_group_heals_on_its_first_step(outage_run):
    _, _, records = outage_run
    pid = records["g1"][0]["pid"]
    first_life = [r for r in records["g1"] if r["pid"] == pid]
    second_life = [r for r in records["g1"] if r["pid"] != pid]
    assert second_life and second_life[0]["heals"] == 1 and second_life[0]["step"] > first_life[-1]["step"]
    assert second_life[-1]["step"] == OUTAGE_STEPS
    survivor = _by_step(records["g0"])
    for r in second_life:
        assert r["state"] == survivor[r["step"]]["state"] and r["loss"] == survivor[r["step"]]["loss"], r["step"]
    assert any(r["participants"] == 1 for r in records["g0"] if r["step"] > first_life[-1]["step"]), \
        "the survivor never trained alone while group 1 was down"


CKPT_STEPS, CKPT_AT = 6, 3


def _ckpt_args(folder: Path) -> list[str]:
    return [*COMMON, f"--training.steps={CKPT_STEPS}", "--lr_scheduler.warmup_steps=1",
            "--checkpoint.enable_checkpoint", f"--checkpoint.folder={folder}", f"--checkpoint.interval={CKPT_AT}"]


def _ft_groups(tmp: Path, name: str, args: list[str], address: str) -> dict[str, subprocess.Popen]:
    ft = ["--fault_tolerance.enable", "--fault_tolerance.num_replica_groups=2", "--fault_tolerance.min_replicas=2",
          f"--fault_tolerance.lighthouse={address}"]
    return {f"{name}{g}": subprocess.Popen(
        [sys.executable, ENTRY, *args, *ft, f"--fault_tolerance.replica_id={g}",
         f"--job.dump_folder={tmp / f'{name}{g}'}"],
        env=_env(tmp / f"{name}{g}"), stdout=open(tmp / f"{name}{g}.log", "w"), stderr=subprocess.STDOUT,
        start_new_session=True) for g in (0, 1)}


def _plain(tmp: Path, name: str, args: list[str]) -> subprocess.Popen:
    """One plain process (no fault tolerance) training the two groups' global batch."""
    return subprocess.Popen([sys.executable, ENTRY, *args, "--training.batch_size=2",
                             f"--job.dump_folder={tmp / name}"],
                            env=_env(tmp / name), stdout=open(tmp / f"{name}.log", "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


@pytest.fixture(scope="module")
def ckpt_run(tmp_path_factory):
    """Two one-rank groups save at steps 3 and 6 into one folder, and one plain process with their global
    batch saves into another. Then, from copies of the groups' step 3: the two groups again (a whole-job
    restart) and a plain process; and from the plain process's step 3: two groups (with a lighthouse of
    their own: a separate job)."""
    tmp = tmp_path_factory.mktemp("ft_ckpt")
    lighthouse, address = _lighthouse(tmp, min_replicas=2)  # no group takes a step alone
    second = _start_lighthouse(tmp, 2, port := free_port())
    try:
        procs = _ft_groups(tmp, "g", _ckpt_args(tmp / "ckpt"), address)
        procs["src"] = _plain(tmp, "src", _ckpt_args(tmp / "ckpt_src"))
        codes = _wait(procs, tmp, timeout=120)
        shutil.copytree(tmp / "ckpt", tmp / "ckpt_ft")
        shutil.copytree(tmp / "ckpt", tmp / "ckpt_plain")
        resume = f"--checkpoint.load_step={CKPT_AT}"
        procs = _ft_groups(tmp, "r", [*_ckpt_args(tmp / "ckpt_ft"), resume], address)
        procs["plain"] = _plain(tmp, "plain", [*_ckpt_args(tmp / "ckpt_plain"), resume])
        procs.update(_ft_groups(tmp, "p", [*_ckpt_args(tmp / "ckpt_src"), resume], f"http://localhost:{port}"))
        codes.update(_wait(procs, tmp, timeout=120))
    finally:
        for server in (lighthouse, second):
            server.kill()
            server.wait()
    records = {name: _records(tmp / f"{name}.0") for name in ("g0", "g1", "r0", "r1", "plain", "src", "p0", "p1")}
    logs = {name: (tmp / f"{name}.log").read_text() for name in ("g0", "g1")}
    return tmp, codes, records, logs


def test_one_group_writes_each_checkpoint(ckpt_run):
    tmp, codes, _, logs = ckpt_run
    assert set(codes.values()) == {0}, codes
    assert sorted(p.name for p in (tmp / "ckpt").iterdir()) == [f"step-{CKPT_AT}", f"step-{CKPT_STEPS}"]
    for step in (CKPT_AT, CKPT_STEPS):
        writers = [g for g, log in logs.items() if f"Checkpoint step {step} saved" in log]
        assert len(writers) == 1, f"step {step} written by {writers}"


def _assert_close(records: list[dict], expected: dict[int, dict], what: str) -> None:
    for r in records:
        want = expected[r["step"]]["loss"]
        assert abs(r["loss"] - want) <= 1e-5 * abs(want), (what, r["step"], r["loss"], want)


def test_whole_job_and_plain_run_resume_at_the_saved_step(ckpt_run):
    _, _, records, _ = ckpt_run
    first = _by_step(records["g0"])
    for name in ("r0", "r1", "plain", "p0", "p1"):
        assert [r["step"] for r in records[name]] == list(range(CKPT_AT + 1, CKPT_STEPS + 1)), name
    for r0, r1 in zip(records["r0"], records["r1"]):
        # The restarted groups retrain steps 4-6 exactly as the first time.
        assert r0["state"] == r1["state"] == first[r0["step"]]["state"] and r0["loss"] == first[r0["step"]]["loss"]
    _assert_close(records["src"], first, "plain run from scratch")
    _assert_close(records["plain"], first, "plain run resumed from the groups' checkpoint")


def test_groups_resume_from_a_plain_runs_checkpoint(ckpt_run):
    _, _, records, _ = ckpt_run
    for p0, p1 in zip(records["p0"], records["p1"]):
        assert p0["state"] == p1["state"] and p0["loss"] == p1["loss"], p0["step"]
    _assert_close(records["p0"], _by_step(records["src"]), "groups resumed from the plain run's checkpoint")
