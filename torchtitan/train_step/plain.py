"""The optimizer step of a job that is one process group (every layout: FSDP, HSDP, TP, CP, PP)."""

from __future__ import annotations

from torchtitan.batch import Batch
from torchtitan.distributed.collectives import start_sum
from torchtitan.train_step.base import StepOutput, StepStrategy


class PlainStep(StepStrategy):
    """forward/backward -> the tail (``StepStrategy.finish``), the loss summed over the group meanwhile."""

    def _run(self, batches: list[Batch], step: int) -> StepOutput:
        scale = self.local_scale(batches)
        local_loss_sum = self.forward_backward(batches, scale)
        # Summed while clipping and the optimizer step run: nothing before the loss needs it.
        out = self.finish(step, start_sum(local_loss_sum, self.parts.loss_mesh), scale)
        assert out is not None  # only a fault-tolerant vote drops a step
        return out
