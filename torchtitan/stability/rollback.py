"""After ``max_consecutive_skips`` skipped steps in a row: reload the last checkpoint and pass over the data
that followed it (PaLM, OLMo: a restart from before the spike, on other batches).

The guard flags it on the device; the trainer sees the flag at its next host read (a step that logs,
validates or may checkpoint, so never after writing a checkpoint of such a streak) and calls
``roll_back``. The checkpoint brings back the model, the optimizer, the LR schedule, the data position and
the guard's own state; the data of the steps after the checkpoint, up to the step that noticed the streak,
is then read and dropped, so training continues on the batches that come after that window. The guard
counts the steps of data so passed over (a checkpoint state), so the log can name each window's place
in the run's sample stream.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Protocol

from torchtitan.stability.guard import BadStepGuard

logger = logging.getLogger(__name__)

# A run that keeps coming back to one checkpoint is not meeting bad data but diverging from there.
MAX_ROLLBACKS_TO_ONE_CHECKPOINT = 3


class Reloads(Protocol):
    def reload_latest(self) -> int | None: ...


class Rollback:
    """Rolls a run back to its last checkpoint and past the data window after it; counts the returns."""

    def __init__(self, guard: BadStepGuard, samples_per_step: int, rank: int):
        self.guard, self.samples_per_step, self.rank = guard, samples_per_step, rank
        self.returns: dict[int, int] = {}  # checkpoint step -> rollbacks to it in this run

    def __call__(self, checkpointer: Reloads, noticed_at: int,
                 start_data: Callable[[int], Iterator], micro_batches_per_step: int) -> tuple[int, Iterator]:
        """Reload and skip; return the step to continue after and the data iterator to continue with."""
        skips = self.guard.max_consecutive
        skipped = self.guard.skipped.clone()  # the run's count goes on; the rest of the guard comes back loaded
        step = checkpointer.reload_latest()
        if step is None:
            raise FloatingPointError(
                f"{skips} steps in a row were skipped (noticed at step {noticed_at}) and there is no checkpoint to "
                "roll back to: set --checkpoint.enable_checkpoint with an --checkpoint.interval that saves before "
                "then, or raise --stability.max_consecutive_skips")
        self.returns[step] = self.returns.get(step, 0) + 1
        if self.returns[step] > MAX_ROLLBACKS_TO_ONE_CHECKPOINT:
            raise FloatingPointError(
                f"rolled back to the checkpoint of step {step} {MAX_ROLLBACKS_TO_ONE_CHECKPOINT} times already and "
                f"the run skipped {skips} steps in a row again (noticed at step {noticed_at}): training diverges "
                "from there whatever the data; lower --optimizer.lr or check the model")
        # The loaded state's count: the data windows passed over before that checkpoint was written.
        before = int(self.guard.data_steps_skipped)
        window = noticed_at - step
        first = (step + before) * self.samples_per_step
        if self.rank == 0:
            logger.warning(
                "Rollback: %d steps in a row skipped (noticed at step %d); reloaded the checkpoint of step %d and "
                "skip the data of steps %d-%d (the run's global samples %d-%d, counted from 0)",
                skips, noticed_at, step, step + 1, noticed_at, first, first + window * self.samples_per_step - 1)
        self.guard.after_rollback(window)
        self.guard.skipped.copy_(skipped)
        data = start_data(step)
        for _ in range(window * micro_batches_per_step):
            next(data)
        return step, data
