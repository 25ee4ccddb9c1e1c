"""The step protocol of a fault-tolerant replica group.

    refresh the heal state -> start the quorum -> forward/backward (the FSDP hooks all-reduce
    gradients across groups on the last micro-batch) -> global loss -> clip -> should_commit?
      yes: optimizer, LR scheduler step; the trainer's step counts; every replica_check_freq
           steps the groups compare fingerprints of their weights and optimizer state
      no:  drop the gradients and run the same batches again

Token counts and loss sums are summed over the live groups too, so the gradient is the
sum over every live group's tokens divided by their count (as plain HSDP computes it), and
every rank of every group logs the same loss.

Host reads: the commit vote (``should_commit``) is the one a step always makes; the token
counts, loss sums and grad norm stay on the device, as in the plain step. The replica check
reads its fingerprints every ``replica_check_freq`` steps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch.distributed.distributed_c10d import ReduceOp

from torchtitan.batch import Batch
from torchtitan.config.job_config import FaultTolerance
from torchtitan.distributed.collectives import start_sum
from torchtitan.fault_tolerance.data import GroupPosition, RepositionableBatches
from torchtitan.fault_tolerance.hooks import set_gradient_sync
from torchtitan.fault_tolerance.manager_protocol import FTManager
from torchtitan.fault_tolerance.replica_check import check_replicas, fingerprint, model_and_optimizer_tensors
from torchtitan.fault_tolerance.state import HealState
from torchtitan.loss import LossScale, scale_over
from torchtitan.train_step.base import StepOutput, StepParts, StepStrategy

logger = logging.getLogger(__name__)


def sum_across_groups(manager: FTManager, value: torch.Tensor) -> torch.Tensor:
    """``value`` summed over the live groups (a healing group adds 0 and receives the others' sum), on its device."""
    t = value.detach().to(torch.float64).clone()
    manager.allreduce(t, reduce_op=ReduceOp.SUM).wait()
    return t


class CrossGroupLossScale:
    """``LossScale`` over every live group: FSDP averages within the group, the hooks over the groups."""

    def __init__(self, group_scale: LossScale, manager: FTManager):
        self._group, self._manager = group_scale, manager
        self._global_tokens: torch.Tensor | None = None
        self._scale: torch.Tensor | None = None

    @property
    def global_tokens(self) -> torch.Tensor:
        if self._global_tokens is None:
            self._global_tokens = sum_across_groups(self._manager, self._group.global_tokens)
        return self._global_tokens

    def __call__(self) -> torch.Tensor:
        # ranks x groups / tokens: the two averages (in-group FSDP, cross-group hook) turn it back into the sum.
        if self._scale is None:
            self._scale = scale_over(self._group.ranks * self._manager.num_participants(), self.global_tokens)
        return self._scale


class FaultTolerantStep(StepStrategy):
    """Runs a trainer's steps under torchft: only committed steps count."""

    def __init__(self, parts: StepParts, manager: FTManager, state: HealState, position: GroupPosition,
                 ft_cfg: FaultTolerance):
        super().__init__(parts)
        self.manager, self.state, self.position = manager, state, position
        self.replica_id, self.num_replica_groups = ft_cfg.replica_id, ft_cfg.num_replica_groups
        self.replica_check_freq = ft_cfg.replica_check_freq
        self.discarded = 0  # steps thrown away (a group died or joined mid-step), for logs and tests
        self.participants = 0  # the groups the last committed step was averaged over
        self._closed = False

    @property
    def heals(self) -> int:
        """Times this group took a peer's state."""
        return self.position.heals

    def start(self, step: int) -> RepositionableBatches:
        """Begin training after ``step`` (0, or a loaded checkpoint's): the batches from the loaded position on.

        torchft's step counter follows the trainer's, so a group resumed from an older checkpoint
        (or none) than its peers heals from them instead of training on beside them.
        """
        self.manager.load_state_dict({"step": step, "batches_committed": 0})
        return self.position.start()

    def writes_checkpoint(self) -> bool:
        """The job's checkpoints are written by one live group: the one ranked first in the step's quorum."""
        return self.manager.participating_rank() == 0

    def _run(self, batches: list[Batch], step: int) -> StepOutput:
        """One committed optimizer step over ``batches``; the same batches again after a discarded one."""
        self.position.step = step
        while True:
            out = self._attempt(batches, step)
            if out is not None:
                return out
            self.discarded += 1
            logger.warning("Fault tolerance: step %d discarded (%s); retrying the same batches", self.position.step,
                           self.manager.errored() or "too few live groups")

    def reduce_on_last(self, batches: list[Batch]) -> Callable[[int], None]:
        """Before each micro-batch: FSDP reduces (and the cross-group hooks run) on the last one only."""
        last = len(batches) - 1
        return lambda i: set_gradient_sync(self.parts.model_parts, i == last)

    def _attempt(self, batches: list[Batch], step: int) -> StepOutput | None:
        """forward/backward -> the tail, with the commit vote; None when the step was discarded."""
        self.state.refresh()
        self.manager.start_quorum()
        scale = CrossGroupLossScale(self.local_scale(batches), self.manager)
        local_loss_sum = self.forward_backward(batches, scale, self.reduce_on_last(batches))
        # The same in every live group: they all stop together at a non-finite loss.
        loss_sum = sum_across_groups(self.manager, start_sum(local_loss_sum, self.parts.loss_mesh)())
        return self.finish(step, lambda: loss_sum, scale)

    # ---- the tail's hooks ------------------------------------------------------------
    def commit(self) -> bool:
        """The groups' vote; a healing group takes its peer's state in here."""
        return self.manager.should_commit()

    def global_sum(self, local: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Over the group's ranks, then the live groups (as the loss sum is)."""
        group_sum = start_sum(local, self.parts.loss_mesh)
        return lambda: sum_across_groups(self.manager, group_sum())

    def before_optimizer_step(self) -> None:
        self.participants = self.manager.num_participants()

    def after_step(self) -> None:
        self._maybe_check_replicas()

    def step_taken(self, step: int) -> int:
        return self.position.step

    def _maybe_check_replicas(self) -> None:
        step = self.position.step
        if self.replica_check_freq and step % self.replica_check_freq == 0:
            value = fingerprint(model_and_optimizer_tensors(self.parts.model_parts, self.parts.optimizer))
            check_replicas(self.manager, self.replica_id, self.num_replica_groups, value, step)

    def close(self, wait: bool = True) -> None:
        """Stop the manager's server, quorum thread and heal server (once)."""
        if not self._closed:
            self.manager.shutdown(wait=wait)
            self._closed = True
