"""The step protocol of a fault-tolerant replica group.

    refresh the heal state -> start the quorum -> forward/backward (the FSDP hooks all-reduce
    gradients across groups on the last micro-batch) -> global loss -> clip -> should_commit?
      yes: optimizer, LR scheduler step; the trainer's step counts; every replica_check_freq
           steps the groups compare fingerprints of their weights and optimizer state
      no:  drop the gradients and run the same batches again

Token counts and loss sums are summed over the live groups too, so the gradient is the
sum over every live group's tokens divided by their count (as plain HSDP computes it), and
every rank of every group logs the same loss.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch
from torch.distributed.distributed_c10d import ReduceOp
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan.distributed import clip_grad_norm_
from torchtitan.distributed.collectives import start_sum
from torchtitan.distributed.grads import match_grad_placements
from torchtitan.fault_tolerance.data import RepositionableBatches
from torchtitan.fault_tolerance.replica_check import check_replicas, fingerprint, model_and_optimizer_tensors
from torchtitan.fault_tolerance.state import HealState
from torchtitan.loss import LossScale


class Trainer(Protocol):
    """What the fault-tolerant step and its set-up use of the trainer that runs them.

    A protocol, so this package stays below the trainer: the trainer imports it, not the reverse.
    """

    cfg: Any
    step: int
    device: torch.device
    model_parts: list[torch.nn.Module]
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    loss_mesh: Any
    dataloader: StatefulDataLoader
    checkpointer: Any

    def accumulate_gradients(
        self, batches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor | float, LossScale]:
        ...

    def check_finite(self, loss: float) -> None:
        ...

logger = logging.getLogger(__name__)


def sum_across_groups(manager: Any, value: float) -> float:
    """``value`` summed over the live groups (a healing group adds 0 and receives the others' sum)."""
    t = torch.tensor(value, dtype=torch.float64)
    manager.allreduce(t, reduce_op=ReduceOp.SUM).wait()
    return float(t)


class CrossGroupLossScale:
    """``LossScale`` over every live group: FSDP averages within the group, the hooks over the groups."""

    def __init__(self, group_scale: LossScale, manager: Any):
        self._group, self._manager = group_scale, manager
        self._global_tokens: float | None = None

    @property
    def global_tokens(self) -> float:
        if self._global_tokens is None:
            self._global_tokens = sum_across_groups(self._manager, self._group.global_tokens)
        return self._global_tokens

    def __call__(self) -> float:
        # ranks x groups / tokens: the two averages (in-group FSDP, cross-group hook) turn it back into the sum.
        return self._group.ranks * self._manager.num_participants() / self.global_tokens


class FaultTolerantStep:
    """Runs a trainer's steps under torchft: only committed steps count."""

    def __init__(self, manager: Any, state: HealState, dataloader: StatefulDataLoader):
        self.manager, self.state, self.dataloader = manager, state, dataloader
        self.batches: RepositionableBatches | None = None  # made by start(), after a checkpoint is loaded
        self.discarded = 0  # steps thrown away (a group died or joined mid-step), for logs and tests
        self.heals = 0  # times this group took a peer's state
        self.lr = 0.0  # the learning rate of the last committed step (a healed group's is its peer's)
        self.participants = 0  # the groups the last committed step was averaged over

    def start(self, step: int) -> RepositionableBatches:
        """Begin training after ``step`` (0, or a loaded checkpoint's): the batches from the loaded position on.

        torchft's step counter follows the trainer's, so a group resumed from an older checkpoint
        (or none) than its peers heals from them instead of training on beside them.
        """
        self.manager.load_state_dict({"step": step, "batches_committed": 0})
        self.batches = RepositionableBatches(self.dataloader)
        return self.batches

    def global_scale(self, group_scale: LossScale) -> CrossGroupLossScale:
        return CrossGroupLossScale(group_scale, self.manager)

    def train_step(self, trainer: Trainer, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
        """One committed optimizer step over ``batches``; returns (global loss, grad norm)."""
        while True:
            self.state.refresh()
            self.manager.start_quorum()
            local_loss_sum, scale = trainer.accumulate_gradients(batches)
            loss_sum = sum_across_groups(self.manager, start_sum(local_loss_sum, trainer.loss_mesh)())
            params = [p for part in trainer.model_parts for p in part.parameters()]
            match_grad_placements(params)
            grad_norm = clip_grad_norm_(params, trainer.cfg.training.max_norm)
            if self.manager.should_commit():  # a healing group takes its peer's state in here
                self.lr = trainer.optimizer.param_groups[0]["lr"]
                self.participants = self.manager.num_participants()
                trainer.optimizer.step()
                trainer.lr_scheduler.step()
                trainer.optimizer.zero_grad(set_to_none=True)
                self._maybe_check_replicas(trainer)
                loss = loss_sum / scale.global_tokens  # the same in every live group: they all stop together
                trainer.check_finite(loss)
                return loss, float(grad_norm)
            trainer.optimizer.zero_grad(set_to_none=True)
            self.discarded += 1
            logger.warning("Fault tolerance: step %d discarded (%s); retrying the same batches", trainer.step,
                           self.manager.errored() or "too few live groups")

    def _maybe_check_replicas(self, trainer: Trainer) -> None:
        ft = trainer.cfg.fault_tolerance
        if ft.replica_check_freq and trainer.step % ft.replica_check_freq == 0:
            value = fingerprint(model_and_optimizer_tensors(trainer.model_parts, trainer.optimizer))
            check_replicas(self.manager, ft.replica_id, ft.num_replica_groups, value, trainer.step)

    def trainer_state(self, trainer: Trainer) -> dict[str, Any]:
        """The step being taken and the data position after its batches: what a healed group continues from."""
        return {"step": trainer.step, "data": self.batches.position()}

    def load_trainer_state(self, trainer: Trainer, state: dict[str, Any]) -> None:
        trainer.step = int(state["step"])
        self.batches.move_to(state["data"])
        self.heals += 1
        logger.info("Fault tolerance: healed from a live peer at step %d", trainer.step)

    def close(self, wait: bool = True) -> None:
        """Stop the manager's server, quorum thread and heal server (once)."""
        if self.manager is not None:
            self.manager.shutdown(wait=wait)
            self.manager = None
