"""Start-up time: seconds from launching torchrun to the first finished training step.

    python benchmarks/startup.py                 # debug model, 8 CPU ranks, 3 runs
    python benchmarks/startup.py --nproc 2 --runs 1

It launches ``run_llama_train.sh``'s command (torchrun + train.py, debug config) and reads
rank 0's log as it is written, noting when each milestone line appears: process group and
mesh, model built and sharded, training loop entered, first step logged, process exit.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEBUG_CONFIG, REPO, load_average, machine_description  # noqa: E402

MILESTONES = [  # (name, text that marks it in rank 0's log)
    ("mesh built", "World mesh"),
    ("model sharded", "Applied "),
    ("loop entered", "Training "),
    ("first step", "step: 1 "),
]


def one_run(nproc: int, extra: list[str]) -> dict[str, float]:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1")
    with tempfile.TemporaryDirectory(prefix="tt_startup_") as dump:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "--local-ranks-filter", "0", str(REPO / "train.py"), "--job.config_file", DEBUG_CONFIG,
               f"--job.dump_folder={dump}", "--job.print_args=false", "--training.steps=1",
               "--lr_scheduler.warmup_steps=0", *extra]  # the debug config warms up for 2 steps
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        seen: dict[str, float] = {}
        assert proc.stdout is not None
        tail: list[str] = []
        for line in proc.stdout:
            tail = (tail + [line])[-20:]
            for name, marker in MILESTONES:
                if name not in seen and marker in line:
                    seen[name] = time.perf_counter() - start
        proc.wait()
        seen["exit"] = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"train.py exited with {proc.returncode}; its last lines:\n{''.join(tail)}")
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="extra config overrides, after --")
    args = parser.parse_args()
    print(f"machine: {machine_description()}; load average before: {load_average()}")
    runs = [one_run(args.nproc, args.overrides) for _ in range(args.runs)]
    names = [name for name, _ in MILESTONES] + ["exit"]
    print(f"{'milestone':16s} " + " ".join(f"run {i + 1:>2d}" for i in range(len(runs))) + "   median (s)")
    for name in names:
        values = [r.get(name, float("nan")) for r in runs]
        print(f"{name:16s} " + " ".join(f"{v:6.1f}" for v in values) + f"   {statistics.median(values):6.1f}")
    print(f"load average after: {load_average()}")


if __name__ == "__main__":
    main()
