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

import torch

from torchtitan.train_step.base import StepOutput


class StepReadout:
    """The steps' losses, on the device until the next read; ``losses`` holds those read so far."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.steps_taken = 0  # steps of this run (since the trainer started or resumed)
        self._pending: list[tuple[int, torch.Tensor]] = []

    def add(self, out: StepOutput) -> None:
        self._pending.append((out.step, out.loss))
        self.steps_taken += 1

    def read(self, grad_norm: torch.Tensor | None = None) -> tuple[float, float]:
        """The last loss and ``grad_norm`` on the host (one read with the unread losses); raises at a non-finite
        loss."""
        if not self._pending:
            return (self.losses[-1] if self.losses else math.nan), math.nan
        device = self._pending[-1][1].device
        values = [loss for _, loss in self._pending]
        if grad_norm is not None:
            values.append(grad_norm.detach().to(device, torch.float64))
        read = torch.stack(values).tolist()  # the one host read (the device finishes the queued steps first)
        losses, norm = read[:len(self._pending)], (read[-1] if grad_norm is not None else math.nan)
        steps = [step for step, _ in self._pending]
        self._pending.clear()
        for step, loss in zip(steps, losses):
            if not math.isfinite(loss):
                raise FloatingPointError(
                    f"loss is {loss} at step {step} (read at step {steps[-1]}): training diverged; lower "
                    "--optimizer.lr, raise --lr_scheduler.warmup_steps or check the data")
        self.losses.extend(losses)
        return losses[-1], norm
