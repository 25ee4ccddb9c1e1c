"""Preemption: a SIGTERM on any rank becomes a save at the end of the same step on every rank."""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


class PreemptionWatch:
    """Notes a SIGTERM while installed; ``agreed()`` tells every rank whether any rank got one."""

    def __init__(self) -> None:
        self.signalled = False
        self._previous_handler: Any = None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            logger.warning("Checkpoint: not on the main thread, so SIGTERM will not trigger a save")
            return

        def on_sigterm(signum, frame) -> None:
            # Only note it: the save happens at the end of the current step, when every
            # rank has agreed (see ``agreed``).
            self.signalled = True
            logger.warning("SIGTERM received: saving a checkpoint at the end of this step, then exiting")

        self._previous_handler = signal.signal(signal.SIGTERM, on_sigterm)

    def uninstall(self) -> None:
        """Give SIGTERM back to the handler that was there before ``install``."""
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None

    def agreed(self) -> bool:
        """True on every rank if any rank got SIGTERM: one tiny all-reduce per step.

        A scheduler may signal only some ranks, or signal them a step apart. Taking the
        max over all ranks after each step makes every rank take the same decision at
        the same step, so they all enter the save together and none waits forever.
        """
        flag = torch.tensor([1 if self.signalled else 0], dtype=torch.int32)
        if dist.is_initialized() and dist.get_world_size() > 1:
            # The default group, from the training thread: the checkpoint group may be busy
            # with an async save in its background thread.
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
