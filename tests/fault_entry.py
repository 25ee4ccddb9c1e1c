"""``train.py`` with one fault injected, chosen by ``$FAULT`` (for tests/test_faults.py).

- ``stop:<rank>:<step>``: that rank sends itself SIGSTOP as step ``<step>`` begins (a
  hung peer: alive, connections open, never answering), after writing the time to
  ``$FAULT_FILE``. The other ranks then wait in the step's first collectives.
- unset: plain ``train.py``.

Every rank writes ``<exit status> <time>`` to ``$FAULT_EXITS/<rank>`` when its training
fails or, failing nothing, as it leaves, so the test learns each rank's own outcome and
when it knew it, even when torchrun stops the rank before it exits.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _install_stop(rank: int, step: int) -> None:
    from torchtitan.trainer import Trainer

    real = Trainer.train_step

    def train_step(self, batches):
        if int(os.environ["RANK"]) == rank and self.step == step:
            Path(os.environ["FAULT_FILE"]).write_text(f"{time.time()}\n")
            os.kill(os.getpid(), signal.SIGSTOP)
        return real(self, batches)

    Trainer.train_step = train_step


def _record(status: int) -> None:
    """Note this rank's outcome once, the first time it is known."""
    exits = os.environ.get("FAULT_EXITS")
    if exits and not Path(exits, os.environ["RANK"]).exists():
        Path(exits, os.environ["RANK"]).write_text(f"{status} {time.time()}\n")


def _record_failures() -> None:
    # The moment training fails on this rank: torchrun may stop the rank (SIGTERM) while it
    # tears down, before train.main() returns.
    from torchtitan.trainer import Trainer

    real = Trainer.train

    def train(self):
        try:
            return real(self)
        except BaseException:
            _record(1)
            raise

    Trainer.train = train


if __name__ == "__main__":
    fault = os.environ.get("FAULT", "")
    if fault.startswith("stop:"):
        _, rank, step = fault.split(":")
        _install_stop(int(rank), int(step))
    _record_failures()
    import train

    status = train.main()
    _record(status)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
