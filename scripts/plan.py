"""Plan a training job on a named cluster, from one CPU: memory per rank, traffic, step time, MFU.

    python scripts/plan.py --cluster h100-sxm-80g --world_size 512 \\
        --job.config_file train_configs/llama3_405b.toml [--json] [--search] [train.py overrides]

See docs/planning.md. ``python train.py --dry_run --world_size N ...`` runs the dry run alone.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from torchtitan.planning.cli import plan_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(plan_main(sys.argv[1:]))
