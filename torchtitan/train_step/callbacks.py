"""Callbacks at named points of an optimizer step: how tests inject faults and the planner watches a step.

The model runner and the step strategy call ``StepCallbacks.emit`` at each ``StepPoint``; every
callback of the list receives a ``StepEvent`` naming the point, the step, the strategy running it
(whose ``parts`` hold the runner, the model parts and the optimizer) and, where there is one, the
micro-batch or the step's output. A callback may read and change what it is handed (a test nudges a
weight, saves the gradients, stops its process, records the step); nothing in the step depends
on it, and with no callbacks ``emit`` returns at once.

The points, in the order of a step:

- ``STEP_START``: a step begins, before its batches go to the device (once per step, not per retry);
- ``MICRO_BATCH_START``: before a micro-batch's forward (through the pipeline: a local batch's schedule step);
- ``FORWARD_END``: the micro-batch's logits exist and the loss comes next (not through the pipeline,
  whose schedule runs the loss inside);
- ``BACKWARD_START``: the micro-batch's loss is computed and its backward begins (not through the pipeline);
- ``MICRO_BATCH_END``: after the micro-batch's backward;
- ``GRADIENTS_READY``: every micro-batch's backward is done and the gradients are reduced
  (within the group, and across the groups under fault tolerance), before clipping;
- ``OPTIMIZER_STEP``: the step is to be applied (clipped, and committed under fault tolerance):
  just before the optimizer step;
- ``STEP_END``: the step is taken; the event carries its ``StepOutput``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any


class StepPoint(enum.Enum):
    STEP_START = "step_start"
    MICRO_BATCH_START = "micro_batch_start"
    FORWARD_END = "forward_end"
    BACKWARD_START = "backward_start"
    MICRO_BATCH_END = "micro_batch_end"
    GRADIENTS_READY = "gradients_ready"
    OPTIMIZER_STEP = "optimizer_step"
    STEP_END = "step_end"


@dataclass(frozen=True)
class StepEvent:
    """What a callback is told at a point of a step."""

    point: StepPoint
    step: int  # the step being taken (the trainer's step number)
    strategy: Any  # the ``StepStrategy`` running the step (None outside one)
    micro_batch: int | None = None  # the micro-batch's index, at the micro-batch points
    output: Any = None  # the ``StepOutput``, at ``STEP_END``


StepCallback = Callable[[StepEvent], None]


class StepCallbacks:
    """The callbacks of a job's steps, called in the order they were added at every point."""

    def __init__(self, callbacks: Iterable[StepCallback] = ()):
        self._callbacks: list[StepCallback] = list(callbacks)
        self.step = 0
        self.strategy: Any = None

    def add(self, callback: StepCallback) -> None:
        self._callbacks.append(callback)

    def begin(self, strategy: Any, step: int) -> None:
        """A step begins: later events name ``step`` and ``strategy``; emits ``STEP_START``."""
        self.strategy, self.step = strategy, step
        self.emit(StepPoint.STEP_START)

    def emit(self, point: StepPoint, micro_batch: int | None = None, output: Any = None) -> None:
        if not self._callbacks:
            return
        event = StepEvent(point, self.step, self.strategy, micro_batch, output)
        for callback in self._callbacks:
            callback(event)
