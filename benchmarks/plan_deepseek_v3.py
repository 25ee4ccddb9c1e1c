"""The planner's prediction for a shipped DeepSeek-V3 config (benchmarks/README.md section 22).

    python benchmarks/plan_deepseek_v3.py deepseek_v3_671b 2048 h100-sxm-80g   # one pp rank per stage shape
    python benchmarks/plan_deepseek_v3.py deepseek_v3_16b 64                    # every rank alike (no PP)

Prints the dry run's wall time, the predicted tokens/s per GPU and the peak memory on the cluster.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.planning.clusters import load_cluster  # noqa: E402
from torchtitan.planning.cost import estimate  # noqa: E402
from torchtitan.planning.dry_run import dry_run  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="a config of train_configs/ by its name (deepseek_v3_671b, deepseek_v3_16b, ...)")
    p.add_argument("world_size", type=int)
    p.add_argument("cluster", nargs="?", default="h100-sxm-80g", help="a cluster file's name (default h100-sxm-80g)")
    a = p.parse_args(argv)
    path = REPO / "train_configs" / f"{a.config}.toml"
    if not path.is_file():
        p.error(f"{path} does not exist: name a config of train_configs/ without .toml")
    start = time.time()
    run = dry_run(ConfigManager().parse_args(["--job.config_file", str(path)]), a.world_size)
    e = estimate(run, load_cluster(a.cluster))
    print(f"{a.config} at {a.world_size}: dry run {time.time() - start:.0f} s; {e.tokens_per_second_per_gpu:.0f} "
          f"tokens/s per GPU, peak {e.peak_memory_gib:.1f} GiB; {run.notes}")


if __name__ == "__main__":
    main()
