#!/usr/bin/env python3
"""Train the same model under several layouts and print how far each loss curve is from the control.

    python scripts/check_parity.py --steps 30 [--ngpu 8] [--layouts fsdp,hsdp,ddp,pp_fsdp,pp_hsdp] [--tolerance 1e-4]

The control is one process with the whole global batch; each layout runs on
``--ngpu`` ranks with the same global batch, seed and data. Per-step losses are read
back from each run's TensorBoard events. Exits 1 when a layout's step-1 loss differs
by more than 1e-6 (relative) or its curve by more than ``--tolerance``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# name -> overrides for N ranks (the local batch is set from the global batch below)
LAYOUTS = {
    "fsdp": lambda n: ["--parallelism.data_parallel_shard_degree", str(n)],
    "hsdp": lambda n: ["--parallelism.data_parallel_replicate_degree", "2",
                       "--parallelism.data_parallel_shard_degree", str(n // 2)],
    "ddp": lambda n: ["--parallelism.data_parallel_replicate_degree", str(n),
                      "--parallelism.data_parallel_shard_degree", "1"],
    # Pipeline layouts (not in the default list): PP 2 with the remaining ranks as FSDP,
    # and PP 2 x HSDP with two stages per rank.
    "pp_fsdp": lambda n: ["--parallelism.pipeline_parallel_degree", "2",
                          "--parallelism.data_parallel_shard_degree", str(n // 2)],
    "pp_hsdp": lambda n: ["--parallelism.pipeline_parallel_degree", "2",
                                      "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
                                      "--parallelism.pipeline_parallel_microbatches", "2",
                                      "--parallelism.data_parallel_replicate_degree", "2",
                                      "--parallelism.data_parallel_shard_degree", str(n // 4)],
}
DEFAULT_LAYOUTS = ("fsdp", "hsdp", "ddp")
# Ranks per layout that share one data-parallel rank (they see the same samples).
NON_DP_RANKS = {"pp_fsdp": 2, "pp_hsdp": 2}


def read_losses(dump: Path) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = sorted((dump / "tb").glob("**/events.out.tfevents.*"))
    if not runs:
        raise SystemExit(f"no TensorBoard events under {dump / 'tb'}")
    acc = EventAccumulator(str(runs[-1].parent))
    acc.Reload()
    return [e.value for e in sorted(acc.Scalars("loss"), key=lambda e: e.step)]


def run(name: str, ranks: int, overrides: list[str], args, root: Path) -> list[float]:
    dump = root / name
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
        str(REPO / "train.py"), "--job.config_file", args.config, f"--job.dump_folder={dump}",
        f"--training.steps={args.steps}", "--metrics.log_freq=1", "--metrics.enable_tensorboard",
        "--training.deterministic", "--job.print_args=false", *overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{name} failed (exit {out.returncode}):\n{out.stderr[-4000:]}")
    return read_losses(dump)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ngpu", type=int, default=8, help="ranks per layout")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per step, all ranks together")
    parser.add_argument("--layouts", default=",".join(DEFAULT_LAYOUTS),
                        help=f"comma-separated, from {', '.join(LAYOUTS)}")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="max relative loss deviation per step")
    parser.add_argument("--config", default=str(REPO / "train_configs" / "debug_model.toml"))
    args = parser.parse_args()
    if args.global_batch % args.ngpu:
        raise SystemExit(f"--global-batch {args.global_batch} must be a multiple of --ngpu {args.ngpu}")
    names = [n for n in args.layouts.split(",") if n]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        raise SystemExit(f"unknown layout(s) {unknown}; choose from {', '.join(LAYOUTS)}")

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        control = run("control", 1, [f"--training.batch_size={args.global_batch}"], args, root)
        curves = {}
        for n in names:
            dp = args.ngpu // NON_DP_RANKS.get(n, 1)
            if args.global_batch % dp:
                raise SystemExit(f"--global-batch {args.global_batch} must be a multiple of {n}'s dp degree {dp}")
            local_batch = [f"--training.batch_size={args.global_batch // dp}"]
            curves[n] = run(n, args.ngpu, LAYOUTS[n](args.ngpu) + local_batch, args, root)

    print(f"{'layout':<10} {'ranks':>5} {'step-1 loss':>12} {'step-1 rel':>11} {'max rel':>9} {'final loss':>11}")
    print(f"{'control':<10} {1:>5} {control[0]:>12.7f} {0:>11.1e} {0:>9.1e} {control[-1]:>11.5f}")
    failed = False
    for name, losses in curves.items():
        rel = [abs(a - b) / abs(b) for a, b in zip(losses, control)]
        ok = len(losses) == len(control) and rel[0] <= 1e-6 and max(rel) <= args.tolerance
        failed |= not ok
        print(f"{name:<10} {args.ngpu:>5} {losses[0]:>12.7f} {rel[0]:>11.1e} {max(rel):>9.1e} {losses[-1]:>11.5f}"
              f"{'' if ok else '  FAIL'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
