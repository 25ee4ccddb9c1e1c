#!/usr/bin/env python3
"""Run short trainings through torchrun again and again; count the runs in which a rank exited non-zero.

    python scripts/stress_exit.py [--runs 50] [--layouts fsdp_cp,tp2] [--steps 3] [--keep-logs DIR]

Each run is ``torchrun --standalone train.py`` on the CI config (tiny model, a few steps).
A run fails when torchrun exits non-zero, which it does when any rank exits non-zero or
dies by a signal (a rank aborting at exit after "Training done" included). The first
lines of every failed run's log are printed, and with ``--keep-logs`` its whole log is
kept. The exit status is 1 if any run failed.

Layouts (ranks): ``fsdp_cp`` is FSDP 2 x CP 2 (4), the integration flavor of that name;
``tp2`` is TP 2 (2); ``fsdp_cp_ckpt`` is FSDP 2 x CP 2 saving a checkpoint every step
with async saves (4), the shutdown path that waits for a pending save.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "train_configs" / "debug_model_ci.toml"

LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "fsdp_cp": (4, ["--parallelism.data_parallel_shard_degree=2", "--parallelism.context_parallel_degree=2",
                    "--training.batch_size=4"]),
    "tp2": (2, ["--parallelism.data_parallel_shard_degree=1", "--parallelism.tensor_parallel_degree=2",
                "--training.batch_size=8"]),
    "fsdp_cp_ckpt": (4, ["--parallelism.data_parallel_shard_degree=2", "--parallelism.context_parallel_degree=2",
                         "--training.batch_size=4", "--checkpoint.enable_checkpoint", "--checkpoint.interval=1",
                         "--checkpoint.async_mode=async"]),
}


def run_once(layout: str, steps: int, dump: str, timeout: float) -> tuple[int, str, float]:
    """(torchrun's exit status, its output, seconds) for one run; 124 on timeout."""
    ranks, overrides = LAYOUTS[layout]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
           str(REPO / "train.py"), "--job.config_file", str(CONFIG), f"--job.dump_folder={dump}",
           f"--training.steps={steps}", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
        return 124, out + f"\n# killed after {timeout:.0f} s\n", time.monotonic() - start


def failure_summary(log: str) -> str:
    """The lines that say how a rank ended (exit codes, signals, tracebacks' last line)."""
    keep = [line for line in log.splitlines()
            if re.search(r"exitcode|Signal|signal|terminate called|Aborted|Error|error:|killed after", line)]
    return "\n".join(keep[-12:]) or "\n".join(log.splitlines()[-12:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=50, help="runs of each layout")
    p.add_argument("--layouts", default="fsdp_cp,tp2", help=f"comma-separated, from {', '.join(LAYOUTS)}")
    p.add_argument("--steps", type=int, default=3, help="training steps per run")
    p.add_argument("--timeout", type=float, default=300, help="seconds before a run counts as hung")
    p.add_argument("--keep-logs", type=Path, help="write each failed run's full log here")
    args = p.parse_args(argv)
    layouts = [name for name in args.layouts.split(",") if name]
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        p.error(f"unknown layout(s) {unknown}; choose from {', '.join(LAYOUTS)}")
    failures = {name: 0 for name in layouts}
    started = time.monotonic()
    for i in range(1, args.runs + 1):
        for name in layouts:  # interleaved, so a change in machine load hits every layout alike
            with tempfile.TemporaryDirectory(prefix="tt_stress_") as dump:
                rc, log, seconds = run_once(name, args.steps, dump, args.timeout)
            done = "Training done" in log
            print(f"run {i:3d} {name:<13} exit {rc:3d} {seconds:5.1f} s{'' if done else '  (no Training done)'}",
                  flush=True)
            if rc != 0:
                failures[name] += 1
                print("    " + failure_summary(log).replace("\n", "\n    "), flush=True)
                if args.keep_logs:
                    args.keep_logs.mkdir(parents=True, exist_ok=True)
                    (args.keep_logs / f"{name}-run{i}.log").write_text(log)
    minutes = (time.monotonic() - started) / 60
    for name in layouts:
        print(f"{name}: {failures[name]} of {args.runs} runs had a rank exit non-zero")
    print(f"{minutes:.1f} min")
    return 1 if any(failures.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
