"""The planner's prediction for a shipped DeepSeek-V3 config (benchmarks/README.md section 22).

    python benchmarks/plan_deepseek_v3.py deepseek_v3_671b 2048 h100-sxm-80g   # one pp rank per stage shape
    python benchmarks/plan_deepseek_v3.py deepseek_v3_16b 64                    # every rank alike (no PP)

Prints the dry run's wall time, the predicted tokens/s per GPU and the peak memory on the cluster.
"""

import sys
import time

from torchtitan.config import ConfigManager
from torchtitan.planning.clusters import load_cluster
from torchtitan.planning.cost import estimate
from torchtitan.planning.dry_run import dry_run


def main() -> None:
    config, world = sys.argv[1], int(sys.argv[2])
    cluster = sys.argv[3] if len(sys.argv) > 3 else "h100-sxm-80g"
    start = time.time()
    run = dry_run(ConfigManager().parse_args(["--job.config_file", f"train_configs/{config}.toml"]), world)
    e = estimate(run, load_cluster(cluster))
    print(f"{config} at {world}: dry run {time.time() - start:.0f} s; {e.tokens_per_second_per_gpu:.0f} tokens/s per "
          f"GPU, peak {e.peak_memory_gib:.1f} GiB; {run.notes}")


if __name__ == "__main__":
    main()
