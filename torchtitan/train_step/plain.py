"""The optimizer step of a job that is one process group (every layout: FSDP, HSDP, TP, CP, PP)."""

from __future__ import annotations

from torchtitan.distributed.collectives import start_sum
from torchtitan.train_step.base import MicroBatches, StepOutput, StepStrategy


class PlainStep(StepStrategy):
    """forward/backward -> clip -> optimizer step -> LR step -> zero_grad -> global loss."""

    def run(self, batches: MicroBatches, step: int) -> StepOutput:
        parts = self.parts
        batches = parts.model.prepare(batches)
        scale = self.local_scale(batches)
        local_loss_sum = parts.model.forward_backward(batches, scale)
        # Summed while clipping and the optimizer step run: nothing before the loss needs it.
        loss_sum = start_sum(local_loss_sum, parts.loss_mesh)
        lr = self.current_lr()
        grad_norm = self.clip()
        parts.optimizer.step()
        parts.lr_scheduler.step()
        self.zero_grad()
        return StepOutput(step=step, loss=loss_sum() / scale.global_tokens, grad_norm=grad_norm, lr=lr)
