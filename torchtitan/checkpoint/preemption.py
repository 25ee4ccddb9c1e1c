"""Preemption: a SIGTERM on any rank becomes a save on every rank, at the end of the next check step.

The ranks agree every ``checkpoint.preemption_check_steps`` steps (the step number is the same
on every rank, so all of them take part in the same agreements): the agreement reads a flag on
the host, which on an accelerator waits for the device, so it is not taken every step.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

from torchtitan.checkpoint.agreement import any_rank

logger = logging.getLogger(__name__)


class PreemptionWatch:
    """Notes a SIGTERM while installed; on check steps ``agreed()`` tells every rank whether any rank got one."""

    def __init__(self, check_steps: int = 1) -> None:
        self.signalled = False
        self.check_steps = check_steps
        self._previous_handler: Any = None

    def due(self, step: int) -> bool:
        """Whether the ranks agree on preemption after ``step`` (every ``check_steps`` steps)."""
        return step % self.check_steps == 0

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            logger.warning("Checkpoint: not on the main thread, so SIGTERM will not trigger a save")
            return

        def on_sigterm(signum, frame) -> None:
            # Only note it: the save happens at the end of the next check step, when every
            # rank has agreed (see ``agreed``).
            self.signalled = True
            logger.warning("SIGTERM received: saving a checkpoint at the next preemption check "
                           "(every %d steps), then exiting", self.check_steps)

        self._previous_handler = signal.signal(signal.SIGTERM, on_sigterm)

    def uninstall(self) -> None:
        """Give SIGTERM back to the handler that was there before ``install``."""
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None

    def agreed(self) -> bool:
        """True on every rank if any rank got SIGTERM: one tiny all-reduce; call it on ``due`` steps only.

        A scheduler may signal only some ranks, or signal them a step apart. Taking the
        max over all ranks at the same step makes every rank take the same decision there,
        so they all enter the save together and none waits forever.
        """
        # The default group, from the training thread: the checkpoint group may be busy
        # with an async save in its background thread.
        return any_rank(self.signalled)
