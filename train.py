"""Entry point: ``torchrun --nproc_per_node N train.py --job.config_file FILE [--section.key=value ...]``.

Also runs as a single process (``python train.py ...``). A config problem prints one
line per problem and exits with status 2 on every rank, before any process group
exists; a failure during training is logged and exits with status 1, which makes
torchrun stop the other ranks rather than leave them waiting.
"""

from __future__ import annotations

import logging
import sys

from torchtitan.config import ConfigError, ConfigManager
from torchtitan.logging_setup import init_logger


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    manager = ConfigManager()
    if "--help" in argv or "-h" in argv:
        print(manager.help_text())
        return 0
    try:
        cfg = manager.parse_args(argv)
        init_logger()
        from torchtitan.trainer import Trainer  # imported late: --help and config errors stay fast

        trainer = Trainer(cfg)
    except ConfigError as e:
        for problem in e.problems:
            print(f"config error: {problem}", file=sys.stderr)
        return 2
    try:
        trainer.train()
    except Exception:
        logging.getLogger(__name__).exception("Training failed")
        return 1
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
