"""What the trainer reads of its steps on the host, and when: in one go, on the steps that need it.

On an accelerator a host read of a device value waits for the device, and the next step's
kernels are no longer queued behind the current ones. So a step leaves its loss and grad norm
on the device, and the trainer reads them only on a step that logs, validates or may write a
checkpoint (and at the end of training): ``read`` copies every loss since the last read and the
current grad norm in one ``tolist()``, and checks there that the losses are finite. A diverged
run so stops at the next read, before any checkpoint of it is written; every rank (every live
group under fault tolerance) holds the same global loss, so all stop there together.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from torchtitan.train_step.base import StepOutput


class StepReadout:
    """The steps' losses, on the device until the next read; ``losses`` holds those read so far."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.steps_taken = 0  # steps of this run (since the trainer started or resumed)
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor | None]] = []

    def add(self, out: StepOutput) -> None:
        self._pending.append((out.step, out.loss, out.skipped))
        self.steps_taken += 1

    def read(self, current: Mapping[str, torch.Tensor | None] | None = None) -> tuple[float, dict[str, float]]:
        """The last loss and the ``current`` values on the host (one read with the unread losses and their skip
        flags); raises at a non-finite loss of a step that was not skipped. A None in ``current`` is left out."""
        current = {name: value for name, value in (current or {}).items() if value is not None}
        if not self._pending:
            return (self.losses[-1] if self.losses else math.nan), {name: math.nan for name in current}
        device = self._pending[-1][1].device
        n = len(self._pending)
        values = [loss for _, loss, _ in self._pending]
        values += [skipped.to(device, torch.float64) if skipped is not None else torch.zeros((), dtype=torch.float64,
                   device=device) for _, _, skipped in self._pending]
        values += [value.detach().to(device, torch.float64) for value in current.values()]
        read = torch.stack(values).tolist()  # the one host read (the device finishes the queued steps first)
        losses, skipped, now = read[:n], read[n:2 * n], dict(zip(current, read[2 * n:]))
        steps = [step for step, _, _ in self._pending]
        self._pending.clear()
        for step, loss, skip in zip(steps, losses, skipped):
            if not math.isfinite(loss) and not skip:
                raise FloatingPointError(
                    f"loss is {loss} at step {step} (read at step {steps[-1]}): training diverged; lower "
                    "--optimizer.lr, raise --lr_scheduler.warmup_steps, check the data, or skip such steps "
                    "(--stability.skip_nonfinite_steps, docs/stability.md)")
        self.losses.extend(losses)
        return losses[-1], now
