"""Entry point: ``torchrun --nproc_per_node N train.py --job.config_file FILE [--section.key=value ...]``.

Also runs as a single process (``python train.py ...``); ``python train.py --preflight_only ...``
only checks the job (``run_llama_train.sh`` does so once before starting torchrun);
``python train.py --dry_run --world_size N ...`` simulates it at that world size (docs/planning.md).
A config problem prints one line per problem and exits with status 2 on every rank, before any process group
exists; a checkpoint save that does not fit on its disk prints one line on every rank and
exits with status 74 (``torchtitan/checkpoint/space.py``, docs/checkpoint_integrity.md). In both cases,
under torchrun, a rank waits (at most 10 s) until every rank has printed its line before it exits, since
torchrun stops all ranks at the first exit;
any other failure during training is logged and exits with status 1, which makes
torchrun stop the other ranks rather than leave them waiting.

Every path ends the same way (``shutdown_distributed``): the trainer has closed its
checkpointer (an async save waited for) and its metrics; on success the ranks meet at a
barrier with a timeout; then the process groups are destroyed, before Python's own exit.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Sequence

from torchtitan.agent_watch import exit_if_agent_gone, watch_agent
from torchtitan.config import ConfigError, ConfigManager
from torchtitan.logging_setup import init_logger


def main(argv: list[str] | None = None, callbacks: Sequence[Callable] = ()) -> int:
    """Train (or check, or plan) the job ``argv`` describes; the exit status. ``callbacks`` are the trainer's
    step callbacks (``torchtitan/train_step/callbacks.py``; the fault-injection tests pass theirs)."""
    argv = sys.argv[1:] if argv is None else argv
    manager = ConfigManager()
    if "--help" in argv or "-h" in argv:
        from torchtitan.models.registry import config_help  # imported here: it imports every family

        print(manager.help_text(config_help()))
        return 0
    if argv[:1] == ["--preflight_only"]:
        return preflight_only(manager, argv[1:])
    if argv[:1] == ["--dry_run"]:  # the whole job simulated in this process on fake tensors (docs/planning.md)
        from torchtitan.planning.cli import dry_run_main

        return dry_run_main(argv[1:])
    watch_agent()  # under torchrun: a rank whose agent is gone stops at once (torchtitan/agent_watch.py)
    trainer, status = None, 1
    shutdown_timeout = 60.0
    try:
        cfg = manager.parse_args(argv)
        shutdown_timeout = float(cfg.comm.train_timeout_seconds)
        init_logger()
        from torchtitan.trainer import Trainer  # imported late: --help and config errors stay fast

        trainer = Trainer(cfg, callbacks)
        trainer.train()  # closes the checkpointer (waits for an async save) and the metrics
        status = 0
    except ConfigError as e:
        for problem in e.problems:
            print(f"config error: {problem}", file=sys.stderr)
        status = 2
        _wait_for_peer_reports("config_error")
    except Exception as e:
        exit_if_agent_gone()  # a peer stopped for it and failed this rank's collective: the agent's line, not this
        status = _failure_status(e)
    finally:
        # Runs on every path, KeyboardInterrupt included: a barrier with a timeout on success,
        # then every process group destroyed while the interpreter is alive.
        del trainer  # the model and meshes hold the groups; let them go with them
        if "torch.distributed" in sys.modules:  # not imported: no group to leave (a config error stays fast)
            from torchtitan.distributed.lifecycle import shutdown_distributed

            shutdown_distributed(ok=status == 0, timeout_seconds=shutdown_timeout)
    return status


def _failure_status(error: Exception) -> int:
    """Log a training failure; its exit status. A full checkpoint disk (its own status) and an object store that
    stopped answering are told in their one line, naming the folder or the endpoint, without a traceback."""
    from torchtitan.checkpoint.s3_client import StoreUnansweredError
    from torchtitan.checkpoint.space import DiskFullError

    if isinstance(error, DiskFullError):
        logging.getLogger(__name__).error("%s", error)
        _wait_for_peer_reports("disk_full")
        return DiskFullError.exit_status
    if isinstance(error, StoreUnansweredError):
        logging.getLogger(__name__).error("%s", error)
        return 1
    logging.getLogger(__name__).exception("Training failed")
    return 1


def _wait_for_peer_reports(reason: str) -> None:
    """Under torchrun, let every rank print its line before this one's exit makes torchrun stop them."""
    sys.stderr.flush()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # one process: no peers, and torch stays unimported
        from torchtitan.distributed.lifecycle import wait_for_peer_reports

        wait_for_peer_reports(reason)


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
    # An ordinary exit: by now no thread of ours runs (the data prefetch thread is joined when its
    # iterator closes, and at exit at the latest; the agent watch is a daemon that only polls a pid)
    # and every process group is destroyed.
    sys.exit(main())
