"""Entry point: ``torchrun --nproc_per_node N train.py --job.config_file FILE [--section.key=value ...]``.

Also runs as a single process (``python train.py ...``); ``python train.py --preflight_only ...``
only checks the job (``run_llama_train.sh`` does so once before starting torchrun);
``python train.py --dry_run --world_size N ...`` simulates it at that world size (docs/planning.md). A config problem prints one
line per problem and exits with status 2 on every rank, before any process group
exists; a failure during training is logged and exits with status 1, which makes
torchrun stop the other ranks rather than leave them waiting.

Every path ends the same way (``shutdown_distributed``): the trainer has closed its
checkpointer (an async save waited for) and its metrics; on success the ranks meet at a
barrier with a timeout; then the process groups are destroyed, before Python's own exit.
"""

from __future__ import annotations

import logging
import os
import sys

from torchtitan.config import ConfigError, ConfigManager
from torchtitan.logging_setup import init_logger


_LEFT_A_GROUP = False  # set by main() when this process had joined a process group


def main(argv: list[str] | None = None) -> int:
    global _LEFT_A_GROUP
    argv = sys.argv[1:] if argv is None else argv
    manager = ConfigManager()
    if "--help" in argv or "-h" in argv:
        print(manager.help_text())
        return 0
    if argv[:1] == ["--preflight_only"]:
        return preflight_only(manager, argv[1:])
    if argv[:1] == ["--dry_run"]:  # the whole job simulated in this process on fake tensors (docs/planning.md)
        from torchtitan.planning.cli import dry_run_main

        return dry_run_main(argv[1:])
    trainer, status = None, 1
    shutdown_timeout = 60.0
    try:
        cfg = manager.parse_args(argv)
        shutdown_timeout = float(cfg.comm.train_timeout_seconds)
        init_logger()
        from torchtitan.trainer import Trainer  # imported late: --help and config errors stay fast

        trainer = Trainer(cfg)
        trainer.train()  # closes the checkpointer (waits for an async save) and the metrics
        status = 0
    except ConfigError as e:
        for problem in e.problems:
            print(f"config error: {problem}", file=sys.stderr)
        status = 2
    except Exception:
        logging.getLogger(__name__).exception("Training failed")
    finally:
        # Runs on every path, KeyboardInterrupt included: a barrier with a timeout on success,
        # then every process group destroyed while the interpreter is alive.
        del trainer  # the model and meshes hold the groups; let them go with them
        if "torch.distributed" in sys.modules:  # not imported: no group to leave (a config error stays fast)
            from torchtitan.distributed.lifecycle import shutdown_distributed

            _LEFT_A_GROUP = shutdown_distributed(ok=status == 0, timeout_seconds=shutdown_timeout)
    return status


def preflight_only(manager: ConfigManager, argv: list[str]) -> int:
    """Check the job as each rank will, with no process group: 0 when sound, else 2 and one line per problem.

    ``run_llama_train.sh`` runs this once before torchrun, so a config error exits 2 with its
    lines alone rather than inside torchrun's report of failed ranks. WORLD_SIZE is the job's.
    """
    try:
        cfg = manager.parse_args(argv)
        from torchtitan.preflight import preflight

        preflight(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    except ConfigError as e:
        for problem in e.problems:
            print(f"config error: {problem}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    status = main()
    if not _LEFT_A_GROUP:  # --help, a config error: no group, nothing torn down late
        sys.exit(status)
    # Leave without Python's own teardown. After destroy_process_group torch still keeps
    # some meshes, and with them gloo groups and their threads, alive in DTensor's caches;
    # they would be torn down during interpreter finalization, the window in which a rank
    # now and then died with SIGABRT after "Training done". Everything worth finishing is
    # finished by now: the checkpoint committed, TensorBoard closed, the groups destroyed.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
