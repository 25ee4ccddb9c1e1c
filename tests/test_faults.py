"""Exits and faults through torchrun and train.py, with real processes (gloo).

- Every rank exits 0 after a successful run, in two layouts (the ordered shutdown).
- A hung peer (SIGSTOP) ends the job within the training timeout in layouts whose
  collectives run on flattened groups (FSDP 2 x CP 2 in a training step, HSDP 2 x CP 2
  in a checkpoint save, on the checkpoint's own group); so does a whole
  "node" killed by SIGKILL (one of two torchrun agents with its workers). After each, a
  restart resumes from the last complete checkpoint.

These launch many processes: the fault scenarios run side by side in one test, and
every launch uses the CI config (tiny model, 32-token sequences).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import CI_CONFIG, REPO, load_script

pytestmark = pytest.mark.slow  # every test here starts processes

CONFIG = CI_CONFIG
ENTRY = str(REPO / "tests" / "fault_entry.py")

stress_exit = load_script("scripts/stress_exit.py")


def test_every_rank_exits_zero_run_after_run(tmp_path):
    # scripts/stress_exit.py runs the same launches 50 times each; CI affords two.
    for i, layout in enumerate(["fsdp_cp", "tp2"]):
        rc, log, _ = stress_exit.run_once(layout, 2, str(tmp_path / f"run{i}"), timeout=240)
        ranks, _ = stress_exit.LAYOUTS[layout]
        assert rc == 0, f"run {i} ({layout}) exited {rc}:\n{stress_exit.failure_summary(log)}"
        done = {int(r) for r in re.findall(r"\[rank(\d+)\].*Training done", log)}
        assert done == set(range(ranks)), (layout, done, log[-3000:])
        assert "terminate called" not in log and "Signal" not in log, log[-3000:]
        # The run names its attention mask and kernel (the default: documents masked).
        kernel = "dense document mask (context parallel chunks)" if "cp" in layout else "one causal SDPA per document"
        assert re.search(r"attention mask: block_causal .*kernel: .*" + re.escape(kernel), log), log[-3000:]


def test_a_failure_inside_trainer_construction_is_logged_and_ends_the_job(tmp_path):
    # Rank 1's Trainer() fails after its process group, mesh and metrics exist: train.py logs
    # it, tears down what exists and exits 1; torchrun stops rank 0, which waits at the next collective.
    (tmp_path / "exits").mkdir()
    proc = _torchrun(tmp_path, 2, ["--parallelism.data_parallel_shard_degree=2", "--training.batch_size=4"],
                     tmp_path / "run.log", {"FAULT": "build_fail:1", "FAULT_EXITS": str(tmp_path / "exits")})
    (code,) = _finish([proc], 240)
    log = (tmp_path / "run.log").read_text(errors="replace")
    assert code != 0 and re.search(r"\[rank1\].*Training failed", log), log[-3000:]
    assert "injected: the checkpointer cannot be built" in log
    assert _exits(tmp_path / "exits")[1][0] == 1


# ---- dead peers ------------------------------------------------------------------------
TIMEOUT_S = 20
# The training timeout fires TIMEOUT_S after the peer stopped answering; the rest is the
# rank's own teardown on a loaded machine.
EXIT_WITHIN_S = TIMEOUT_S + 60
FSDP_CP = ["--parallelism.data_parallel_shard_degree=2", "--parallelism.context_parallel_degree=2",
           "--training.batch_size=4"]
HSDP_CP = ["--parallelism.data_parallel_replicate_degree=2", "--parallelism.data_parallel_shard_degree=1",
           "--parallelism.context_parallel_degree=2", "--training.batch_size=4"]
HSDP_2X2 = ["--parallelism.data_parallel_replicate_degree=2", "--parallelism.data_parallel_shard_degree=2",
            "--training.batch_size=2"]
# Checkpoints after every step; a long init timeout, so that only the training timeout
# (on every group) can explain a quick end.
COMMON = ["--training.steps=4", "--checkpoint.enable_checkpoint", "--checkpoint.interval=1",
          f"--comm.train_timeout_seconds={TIMEOUT_S}", "--comm.init_timeout_seconds=900",
          "--metrics.enable_tensorboard=false"]


def _torchrun(dump: Path, ranks: int, overrides: list[str], log: Path, env: dict[str, str],
              node: tuple[int, int] | None = None, common: list[str] = COMMON) -> subprocess.Popen:
    """One torchrun agent; ``node=(node_rank, port)`` makes it one of two agents (c10d rendezvous)."""
    if node is None:
        launch = ["--standalone", f"--nproc_per_node={ranks}"]
    else:
        launch = ["--nnodes=2", f"--node_rank={node[0]}", f"--nproc_per_node={ranks // 2}", "--rdzv_backend=c10d",
                  f"--rdzv_endpoint=127.0.0.1:{node[1]}", f"--rdzv_id=faults-{node[1]}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", *launch, ENTRY, "--job.config_file", CONFIG,
           f"--job.dump_folder={dump}", *common, *overrides]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **env}
    return subprocess.Popen(cmd, env=full_env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _exits(folder: Path) -> dict[int, tuple[int, float]]:
    """rank -> (exit status, time) as fault_entry.py recorded them."""
    return {int(p.name): (int(p.read_text().split()[0]), float(p.read_text().split()[1]))
            for p in folder.iterdir()}


def _wait_for(pattern: str, logs: list[Path], procs: list[subprocess.Popen], limit: float) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if any(re.search(pattern, log.read_text(errors="replace")) for log in logs):
            return
        if all(p.poll() is not None for p in procs):
            break
        time.sleep(0.2)
    tails = "\n".join(log.read_text(errors="replace")[-2000:] for log in logs)
    raise AssertionError(f"/{pattern}/ never appeared:\n{tails}")


def _finish(procs: list[subprocess.Popen], limit: float) -> list[int]:
    deadline = time.monotonic() + limit
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            codes.append(p.wait())
    return codes


def _process_tree(root: int) -> list[int]:
    """``root``'s descendants, deepest first, then ``root`` (torchrun puts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))

    def below(pid: int) -> list[int]:
        return [d for c in children.get(pid, []) for d in below(c)] + [pid]

    return below(root)


def _last_complete_step(dump: Path) -> int:
    steps = [int(p.name.split("-")[1]) for p in (dump / "checkpoint").glob("step-*")
             if p.is_dir() and not p.name.endswith(".tmp") and (p / "checkpoint.json").exists()]
    return max(steps)


def test_a_dead_peer_ends_the_job_and_a_restart_resumes(tmp_path, free_port):
    scenarios = {"fsdp_cp_stop": FSDP_CP, "hsdp_cp_stop": HSDP_CP, "node_killed": HSDP_2X2}
    procs: dict[str, list[subprocess.Popen]] = {}
    for name, overrides in scenarios.items():
        dump, exits = tmp_path / name, tmp_path / name / "exits"
        exits.mkdir(parents=True)
        env = {"FAULT_EXITS": str(exits), "FAULT_FILE": str(dump / "stopped_at")}
        if name == "node_killed":
            port = free_port()
            procs[name] = [_torchrun(dump, 4, overrides, dump / f"agent{n}.log", env, node=(n, port)) for n in (0, 1)]
        else:
            # FSDP x CP: rank 1 stops as step 3 begins; the others wait in FSDP's first all-gather
            # of the step, on dp_shard_cp (a flattened group). HSDP x CP: rank 1 stops as it
            # begins saving step 3; the others wait in the save's barrier, on the checkpoint
            # group (created with a 30-minute timeout).
            fault = "stop:1:3" if name == "fsdp_cp_stop" else "stop_save:1:3"
            procs[name] = [_torchrun(dump, 4, overrides, dump / "agent0.log", {**env, "FAULT": fault})]

    # The whole second agent (its torchrun and both its workers) dies by SIGKILL once step 2 is logged.
    killed = tmp_path / "node_killed"
    _wait_for(r"step: 2 ", [killed / "agent0.log", killed / "agent1.log"], procs["node_killed"], 400)
    for pid in _process_tree(procs["node_killed"][1].pid):  # workers first: their agent would SIGTERM them
        os.kill(pid, signal.SIGKILL)
    (killed / "stopped_at").write_text(f"{time.time()}\n")

    codes = {name: _finish(p, 400) for name, p in procs.items()}
    report = []
    for name in scenarios:
        dump = tmp_path / name
        logs = "".join((dump / f"agent{n}.log").read_text(errors="replace") for n in (0, 1)
                       if (dump / f"agent{n}.log").exists())
        assert (dump / "stopped_at").exists(), f"{name}: the fault never happened:\n{logs[-4000:]}"
        fault_time = float((dump / "stopped_at").read_text())
        assert codes[name][0] != 0, f"{name}: torchrun exited 0"
        exits = _exits(dump / "exits")
        if name == "node_killed":  # the ranks of the agent that lives (c10d assigns them)
            survivors = sorted({int(r) for r in re.findall(r"\[rank(\d+)\]", (dump / "agent0.log").read_text())})
            assert len(survivors) == 2, survivors
        else:
            survivors = [0, 2, 3]
        # Each surviving rank fails on its own (its collective times out or loses its peer), not
        # only when torchrun stops it.
        assert set(survivors) <= set(exits), f"{name}: ranks that recorded an exit: {sorted(exits)}\n{logs[-4000:]}"
        for rank in survivors:
            status, when = exits[rank]
            assert status != 0, f"{name}: rank {rank} exited {status}"
            assert when - fault_time < EXIT_WITHIN_S, f"{name}: rank {rank} left {when - fault_time:.0f} s after"
        report.append(f"{name}: surviving ranks exited {max(exits[r][1] for r in survivors) - fault_time:.1f} s "
                      f"after the fault")
    print("\n".join(report))

    # Restart every scenario without the fault: each resumes after its last complete checkpoint (two of
    # them lost a save midway or a whole node).
    restarts, last = {}, {}
    for name, overrides in scenarios.items():
        dump = tmp_path / name
        last[name] = _last_complete_step(dump)
        restarts[name] = [_torchrun(dump, 4, overrides, dump / "restart.log", {})]
    codes = {name: _finish(p, 400) for name, p in restarts.items()}
    for name in scenarios:
        dump = tmp_path / name
        log = (dump / "restart.log").read_text(errors="replace")
        assert codes[name] == [0], f"{name}: restart exited {codes[name]}:\n{log[-4000:]}"
        resumed = re.search(r"continuing after step (\d+)", log)
        assert resumed, f"{name}: the restart did not load a checkpoint:\n{log[-3000:]}"
        assert int(resumed.group(1)) == last[name], f"{name}: resumed after step {resumed.group(1)}, not {last[name]}"
        if name != "node_killed":
            assert last[name] == 2, f"{name}: the last complete checkpoint is step {last[name]}, not 2"
        assert re.search(r"step: 4 ", log), log[-3000:]


# ---- SIGTERM to torchrun (what Slurm and Kubernetes send) ----------------------------------
FSDP2 = ["--parallelism.data_parallel_shard_degree=2", "--training.batch_size=4", "--training.steps=6",
         "--checkpoint.enable_checkpoint", "--metrics.enable_tensorboard"]
GRACE_S = 30  # torchrun's default: SIGTERM to the workers, SIGKILL this much later


def _snapshot(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*") if p.is_file()}


def test_sigterm_to_torchrun_saves_the_current_step_and_a_restart_resumes_bitwise(tmp_path):
    from integration_tests import read_losses

    ref, term, slow = tmp_path / "reference", tmp_path / "sigterm", tmp_path / "slow_save"
    for d in (ref, term, slow):
        (d / "exits").mkdir(parents=True)
    env = lambda d, **kw: {"FAULT_EXITS": str(d / "exits"), **kw}  # noqa: E731
    procs = {
        "reference": _torchrun(ref, 2, FSDP2, ref / "run.log", env(ref), common=[]),
        "sigterm": _torchrun(term, 2, [*FSDP2, "--checkpoint.interval=100", "--checkpoint.preemption_check_steps=1"],
                             term / "run.log", env(term), common=[]),
        # A checkpoint every 2 steps; the one SIGTERM asks for cannot finish within a 5 s grace.
        "slow": _torchrun(slow, 2, [*FSDP2, "--checkpoint.interval=2", "--checkpoint.preemption_check_steps=1"],
                          slow / "run.log",
                          env(slow, FAULT="slow_save:120", TORCH_ELASTIC_SHUTDOWN_TIMEOUT="5"), common=[]),
    }
    _wait_for(r"step: 2 ", [term / "run.log"], [procs["sigterm"]], 400)
    procs["sigterm"].send_signal(signal.SIGTERM)
    term_time = time.time()
    _wait_for(r"step: 3 ", [slow / "run.log"], [procs["slow"]], 400)
    before = _snapshot(slow / "checkpoint" / "step-2")  # complete: saved (synchronously) after step 2
    procs["slow"].send_signal(signal.SIGTERM)
    codes = {name: _finish([p], 400)[0] for name, p in procs.items()}
    assert codes["reference"] == 0, (ref / "run.log").read_text()[-3000:]

    # Every rank saved the step it was on, then exited 0 within the grace period.
    log = (term / "run.log").read_text(errors="replace")
    saved = re.search(r"Preempted: checkpoint of step (\d+) saved", log)
    assert saved, log[-3000:]
    step = int(saved.group(1))
    assert 2 <= step < 6 and (term / "checkpoint" / f"step-{step}" / "checkpoint.json").exists()
    exits = _exits(term / "exits")
    assert sorted(exits) == [0, 1] and all(status == 0 for status, _ in exits.values()), exits
    assert all(when - term_time < GRACE_S for _, when in exits.values()), (term_time, exits)

    # The save that could not finish: killed at the grace's end, the previous checkpoint intact.
    assert codes["slow"] != 0
    assert _snapshot(slow / "checkpoint" / "step-2") == before
    assert _last_complete_step(slow) == 2
    assert list((slow / "checkpoint").glob("step-*.tmp")), "the interrupted save left no partial folder"

    resumed = {"sigterm": _torchrun(term, 2, [*FSDP2, "--metrics.save_tb_folder=tb_resume"], term / "resume.log",
                                    {}, common=[]),
               "slow": _torchrun(slow, 2, [*FSDP2, "--training.steps=4"], slow / "resume.log", {}, common=[])}
    codes = {name: _finish([p], 400)[0] for name, p in resumed.items()}
    for name, dump in (("sigterm", term), ("slow", slow)):
        assert codes[name] == 0, (dump / "resume.log").read_text()[-3000:]
    assert f"continuing after step {step}" in (term / "resume.log").read_text()
    assert "continuing after step 2" in (slow / "resume.log").read_text()
    # Bitwise the uninterrupted run's losses (float32 TensorBoard scalars).
    reference, after = read_losses(ref / "tb"), read_losses(term / "tb_resume")
    assert sorted(after) == list(range(step + 1, 7)), sorted(after)
    assert {s: reference[s] for s in after} == after
