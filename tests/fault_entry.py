"""``train.py`` with one fault injected, chosen by ``$FAULT`` (for tests/test_faults.py).

- ``stop:<rank>:<step>``: that rank sends itself SIGSTOP as step ``<step>`` begins (a
  hung peer: alive, connections open, never answering), after writing the time to
  ``$FAULT_FILE``; a step callback of the trainer. The other ranks then wait in the step's
  first collectives.
- ``slow_save:<seconds>``: the checkpoint that a SIGTERM triggers writes its data files,
  then hangs that long before it could be committed.
- ``stop_save:<rank>:<step>``: the same, as that rank begins the checkpoint save of
  ``<step>``: the others wait in the save's collectives on the checkpoint group.
- ``build_fail:<rank>``: that rank's ``Trainer()`` raises half-built (not a config error).
- unset: plain ``train.py``.

Every rank writes ``<exit status> <time>`` to ``$FAULT_EXITS/<rank>`` when its training
fails or, failing nothing, as it leaves, so the test learns each rank's own outcome and
when it knew it, even when torchrun stops the rank before it exits.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchtitan.train_step.callbacks import StepCallback, StepEvent, StepPoint  # noqa: E402


def _stop_at(rank: int, step: int) -> StepCallback:
    """A step callback: that rank sends itself SIGSTOP as step ``step`` begins."""

    def callback(event: StepEvent) -> None:
        if event.point is StepPoint.STEP_START and int(os.environ["RANK"]) == rank and event.step == step:
            Path(os.environ["FAULT_FILE"]).write_text(f"{time.time()}\n")
            os.kill(os.getpid(), signal.SIGSTOP)

    return callback


def _install_slow_preempted_save(seconds: float) -> None:
    """The save a SIGTERM asked for writes its data files, then hangs (a slow file system)."""
    import torch.distributed.checkpoint as dcp

    from torchtitan.checkpoint.manager import CheckpointManager

    real_write, real_save = dcp.FileSystemWriter.write_data, CheckpointManager.save

    def save(self, step, **kw):
        if self.preemption.signalled:
            def write_then_hang(writer, plan, planner):
                future = real_write(writer, plan, planner)
                future.wait()
                time.sleep(seconds)
                return future
            dcp.FileSystemWriter.write_data = write_then_hang
        return real_save(self, step, **kw)

    CheckpointManager.save = save


def _install_stop_in_save(rank: int, step: int) -> None:
    """That rank sends itself SIGSTOP as it begins the checkpoint save of ``step``: the
    others wait in the save's collectives, on the checkpoint's own process group."""
    from torchtitan.checkpoint.manager import CheckpointManager

    real = CheckpointManager.save

    def save(self, at_step, **kw):
        if int(os.environ["RANK"]) == rank and at_step == step:
            Path(os.environ["FAULT_FILE"]).write_text(f"{time.time()}\n")
            os.kill(os.getpid(), signal.SIGSTOP)
        return real(self, at_step, **kw)

    CheckpointManager.save = save


def _install_build_failure(rank: int) -> None:
    """That rank's trainer fails half-built (after the metrics, at the checkpointer)."""
    from torchtitan.checkpoint import manager

    real = manager.CheckpointManager.__init__

    def init(self, *args, **kw):
        if int(os.environ["RANK"]) == rank:
            raise RuntimeError("injected: the checkpointer cannot be built on this rank")
        real(self, *args, **kw)

    manager.CheckpointManager.__init__ = init


def _record(status: int) -> None:
    """Note this rank's outcome once, the first time it is known."""
    exits = os.environ.get("FAULT_EXITS")
    if exits and not Path(exits, os.environ["RANK"]).exists():
        Path(exits, os.environ["RANK"]).write_text(f"{status} {time.time()}\n")


class _RecordFailure(logging.Handler):
    """Note this rank's failure the moment train.py logs it: torchrun may stop the rank (SIGTERM)
    while it tears down, before train.main() returns."""

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR:
            _record(1)


if __name__ == "__main__":
    fault = os.environ.get("FAULT", "")
    callbacks = []
    if fault.startswith("stop:"):
        _, rank, step = fault.split(":")
        callbacks.append(_stop_at(int(rank), int(step)))
    elif fault.startswith("stop_save:"):
        _, rank, step = fault.split(":")
        _install_stop_in_save(int(rank), int(step))
    elif fault.startswith("build_fail:"):
        _install_build_failure(int(fault.split(":")[1]))
    elif fault.startswith("slow_save:"):
        _install_slow_preempted_save(float(fault.split(":")[1]))
    logging.getLogger("train").addHandler(_RecordFailure())  # train.py logs a training failure there
    import train

    status = train.main(sys.argv[1:], callbacks)
    _record(status)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
