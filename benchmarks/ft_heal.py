"""Fault-tolerant HSDP: the survivor's stall and the rejoiner's heal against model size.

    python benchmarks/ft_heal.py [--shapes debug,large] [--steps 14] [--kill-at 4]

For each shape, two one-rank replica groups (``tests/fault_tolerance/ft_entry.py``, which
records every committed step) train with a lighthouse (1 s heartbeat). Group 1 is SIGKILLed
right after committing step ``--kill-at`` and started again at once; it heals from group 0
on its first step. From the per-step records:

- *healthy step*: group 0's median step while both groups train;
- *survivor stall*: group 0's step during which group 1 died, minus the healthy step;
- *heal step*: the rejoiner's first step, from its start (quorum, state transfer, forward,
  backward) to its commit; *restart to heal*: from the relaunch to that commit (process
  start, imports, model build included).

The shapes: the debug model (5.8M parameters) and a larger CPU shape given to
``--model.flavor`` as a Meta ``params.json`` (dim 768, 8 layers, 53M parameters). The state a
rejoiner receives is the weights and Adam's two moments, 12 bytes a parameter in float32.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENTRY = str(REPO / "tests" / "fault_tolerance" / "ft_entry.py")
CONFIG = str(REPO / "train_configs" / "debug_model_ci.toml")
sys.path.insert(0, str(REPO))
from torchtitan.distributed.lifecycle import free_port  # noqa: E402

LARGE = {"dim": 768, "n_layers": 8, "n_heads": 12, "n_kv_heads": 4, "vocab_size": 2048, "multiple_of": 256,
         "norm_eps": 1e-5, "rope_theta": 500000.0}


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _flavor(shape: str, work: Path) -> str:
    if shape == "debug":
        return "debugmodel"
    (work / "large").mkdir(exist_ok=True)
    (work / "large" / "params.json").write_text(json.dumps(LARGE))
    return str(work / "large")


def _launch(work: Path, g: int, args: list[str], **env: str) -> subprocess.Popen:
    environ = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "FT_RECORD": str(work / f"g{g}"),
               "PYTHONPATH": str(REPO), **env}
    return subprocess.Popen([sys.executable, ENTRY, *args, f"--fault_tolerance.replica_id={g}",
                             f"--job.dump_folder={work / f'g{g}'}"], env=environ,
                            stdout=open(work / f"g{g}.log", "a"), stderr=subprocess.STDOUT, start_new_session=True)


def _wait_for_step(record: Path, step: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while len(_records(record)) < step:
        if time.monotonic() > deadline:
            raise SystemExit(f"{record} did not reach step {step} in {timeout:.0f} s")
        time.sleep(0.05)


def run_shape(shape: str, steps: int, kill_at: int, work: Path) -> dict:
    """Train two groups, kill and relaunch group 1 after ``kill_at``; return the timings."""
    port = free_port()
    lighthouse = subprocess.Popen(
        ["torchft_lighthouse", "--min_replicas=1", f"--bind=[::]:{port}", "--heartbeat_timeout_ms=1000",
         "--join_timeout_ms=1000", "--quorum_tick_ms=50"], stdout=open(work / "lighthouse.log", "a"),
        stderr=subprocess.STDOUT, start_new_session=True)
    args = [f"--job.config_file={CONFIG}", f"--model.flavor={_flavor(shape, work)}", f"--training.steps={steps}",
            "--metrics.enable_tensorboard=false", "--training.batch_size=1", "--fault_tolerance.enable",
            "--fault_tolerance.num_replica_groups=2", f"--fault_tolerance.lighthouse=http://localhost:{port}",
            "--fault_tolerance.timeout_seconds=20", "--comm.train_timeout_seconds=60",
            "--comm.init_timeout_seconds=120"]
    (work / "start").mkdir()
    together = {"FT_START_TOGETHER": f"{work / 'start'}:2"}
    procs = {0: _launch(work, 0, args, FT_THROTTLE_ALONE="0.5", **together), 1: _launch(work, 1, args, **together)}
    try:
        _wait_for_step(work / "g1.0", kill_at, timeout=600)
        os.killpg(procs[1].pid, signal.SIGKILL)
        procs[1].wait()
        relaunched = time.time()
        procs[1] = _launch(work, 1, args)
        for g, p in procs.items():
            if p.wait(timeout=900) != 0:
                raise SystemExit(f"group {g} failed; see {work / f'g{g}.log'}")
    finally:
        for p in [*procs.values(), lighthouse]:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    return _timings(_records(work / "g0.0"), _records(work / "g1.0"), kill_at, relaunched, work)


def _timings(survivor: list[dict], rejoiner: list[dict], kill_at: int, relaunched: float, work: Path) -> dict:
    steps = {r["step"]: r for r in survivor}
    durations = {s: steps[s]["time"] - steps[s]["began"] for s in steps}
    healthy = statistics.median(durations[s] for s in range(2, kill_at + 1))
    first_healed = next(r for r in rejoiner if r["heals"] == 1)
    log = (work / "g0.log").read_text()
    params = int(log.split(" parameters,")[0].rsplit(": ", 1)[1].replace(",", ""))
    return {"params": params, "healthy": healthy, "stall": durations[kill_at + 1] - healthy,
            "heal_step": first_healed["time"] - first_healed["began"],
            "restart_to_heal": first_healed["time"] - relaunched, "healed_at": first_healed["step"],
            "discarded": survivor[-1]["discarded"],
            "bitwise_after_heal": all(r["state"] == steps[r["step"]]["state"] for r in rejoiner if r["heals"])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="debug,large")
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--kill-at", type=int, default=4)
    args = p.parse_args()
    if shutil.which("torchft_lighthouse") is None:
        raise SystemExit("torchft is not installed: bash scripts/install.sh")
    print("| shape | parameters | state sent (MB) | healthy step (s) | survivor stall (s) | discarded | "
          "heal step (s) | restart to heal (s) | bitwise after heal |")
    print("|---|---|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        with tempfile.TemporaryDirectory(prefix=f"ft_heal_{shape}_") as tmp:
            t = run_shape(shape, args.steps, args.kill_at, Path(tmp))
        print(f"| {shape} | {t['params']:,} | {t['params'] * 12 / 1e6:.0f} | {t['healthy']:.2f} | {t['stall']:.2f} | "
              f"{t['discarded']} | {t['heal_step']:.2f} | {t['restart_to_heal']:.1f} | {t['bitwise_after_heal']} |",
              flush=True)


if __name__ == "__main__":
    main()
