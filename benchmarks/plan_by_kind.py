"""The planner's compute time of one simulated rank, phase by phase and kind by kind (benchmarks/README §21).

    python benchmarks/plan_by_kind.py --cluster h200 [--world_size N] [--rank R] \
        --job.config_file ... (train.py's options)

Runs the dry run of ``scripts/plan.py`` for the job at ``--world_size`` (default 1) and prints, for each
phase, the time ``planning/cost.py`` gives its matmuls, attention, memory-bound kernels and launches,
with the work behind each (FLOPs, bytes, kernels): what to set beside a profiler's kernel table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.planning.clusters import load_cluster  # noqa: E402
from torchtitan.planning.cost import phase_compute_terms  # noqa: E402
from torchtitan.planning.dry_run import dry_run  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cluster", required=True, help="a cluster file's name (torchtitan/planning/clusters)")
    p.add_argument("--world_size", type=int, default=1)
    p.add_argument("--rank", type=int, default=0, help="which simulated rank to print (default: the first)")
    own, rest = p.parse_known_args(argv)
    cluster = load_cluster(own.cluster)
    run = dry_run(ConfigManager().parse_args(rest), own.world_size)
    r = run.ranks[own.rank]
    total = 0.0
    print(f"rank {r.rank} on {cluster.name}: ms (work)")
    for phase, w in r.work.items():
        if phase == "build":
            continue
        t = {k: 1e3 * v for k, v in phase_compute_terms(w, cluster).items()}
        total += sum(t.values())
        print(f"  {phase:<10} matmul {t['matmul'] + t['fp8 matmul']:7.2f} ({w.matmul_flops / 1e12:.2f} TFLOP)"
              f"  attention {t['attention']:6.2f} ({w.attention_flops / 1e12:.2f} TFLOP)"
              f"  memory-bound {t['memory']:7.2f} ({w.memory_bytes / 1e9:.1f} GB)"
              f"  launch {t['launch']:5.2f} ({w.kernels} kernels)"
              + (f"  of the matmuls FP8 {t['fp8 matmul']:7.2f} ({w.fp8_matmul_flops / 1e12:.2f} TFLOP)"
                 if w.fp8_matmul_flops else ""))
    print(f"  compute {total:.1f} ms")


if __name__ == "__main__":
    main()
