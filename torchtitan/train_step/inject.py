"""``--debug.inject_nonfinite_grad``: a NaN gradient at chosen steps, for tests and drills of [stability].

At ``GRADIENTS_READY`` of a chosen step (the gradients reduced, before clipping), every rank makes the
first element of its first non-empty local gradient NaN. The global gradient norm is then NaN on every
rank, as a real overflow makes it. With ``--stability.skip_nonfinite_steps`` the step is skipped;
without it the NaN reaches the weights and the job stops at the next logged loss.

Each step number is injected once per process: a run that rolls back retakes those numbers on other
data, as it does after real bad data (stability/rollback.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

from torchtitan.train_step.callbacks import StepEvent, StepPoint


class NonFiniteGradInjector:
    """A step callback that poisons one gradient element at each of ``steps``."""

    def __init__(self, steps: Iterable[int]):
        self.pending = set(steps)

    def __call__(self, event: StepEvent) -> None:
        if event.point is not StepPoint.GRADIENTS_READY or event.step not in self.pending:
            return
        self.pending.discard(event.step)
        for p in event.strategy.parts.runner.parameters():
            grad = p.grad
            if grad is None:
                continue
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            if local.numel():
                with torch.no_grad():
                    local.view(-1)[0] = float("nan")
                return
