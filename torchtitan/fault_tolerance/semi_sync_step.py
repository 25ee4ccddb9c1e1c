"""The step protocol of a replica group under DiLoCo or LocalSGD (``semi_sync_method``).

    refresh the heal state -> forward/backward (FSDP inside the group only) -> the group's
    loss -> clip -> inner optimizer step; every sync_steps / num_fragments steps torchft's
    hook on that step syncs (quorum, heal, average, should_commit, outer step) -> LR step

Every inner step counts; only syncs are torchft steps (quorum and commit). The loss and
gradient norm are the group's own (its tokens, its local weights): there is no cross-group
collective between syncs, so no global loss exists there.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan.compat import semi_sync_local_step
from torchtitan.distributed import clip_grad_norm_
from torchtitan.distributed.collectives import start_sum
from torchtitan.distributed.grads import match_grad_placements
from torchtitan.fault_tolerance.data import RepositionableBatches
from torchtitan.fault_tolerance.replica_check import check_replicas, fingerprint
from torchtitan.fault_tolerance.semi_sync import SemiSyncState
from torchtitan.fault_tolerance.state import HealState
from torchtitan.fault_tolerance.step import FaultTolerantStep, Trainer
from torchtitan.loss import LossScale

logger = logging.getLogger(__name__)


class SemiSyncStep(FaultTolerantStep):
    """Runs a trainer's steps as DiLoCo/LocalSGD inner steps; torchft's hooks on the optimizer sync."""

    def __init__(self, manager: Any, state: HealState, dataloader: StatefulDataLoader):
        super().__init__(manager, state, dataloader)
        self.semi: SemiSyncState | None = None  # set by enable_fault_tolerance once the algorithm is built
        self.syncs = 0  # committed syncs of this process (tests and logs)
        self.synced = False  # whether the last step ended with a committed sync
        self.started_at = 0  # the step training began after: 0, or a loaded checkpoint's

    def start(self, step: int) -> RepositionableBatches:
        """Begin after ``step``: torchft's step (the syncs) comes from the checkpoint's semi-sync state, if any.

        Without it (a fresh start, or a checkpoint of another mode) the current weights become the
        reference and the sync count starts at 0, so a group behind its peers heals at its first sync.
        """
        self.started_at = step
        if not self.semi.loaded:
            self.semi.restart_from_weights()
            self.manager.load_state_dict({"step": 0, "batches_committed": 0})
        self.batches = RepositionableBatches(self.dataloader)
        return self.batches

    def writes_checkpoint(self, replica_id: int) -> bool:
        """Whether this group writes the job's checkpoint now: the first group of its last sync's quorum.

        Before this process has committed a sync, only group 0 of a fresh start writes: its
        weights up to the first sync depend on nothing but its own seed and data. A group that
        resumed from a checkpoint, or came back while others trained on, trains apart until
        its next sync: its save would replace the job's checkpoint of that step with its own state.
        """
        if self.syncs:
            return self.manager.participating_rank() == 0
        return replica_id == 0 and self.started_at == 0

    def global_scale(self, group_scale: LossScale) -> LossScale:
        return group_scale  # inner steps average over the group's own tokens

    def train_step(self, trainer: Trainer, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
        """One inner step over ``batches`` (and a sync when due); returns (this group's loss, grad norm)."""
        self.state.refresh()  # what a peer healing at this step's sync receives
        local_loss_sum, scale = trainer.accumulate_gradients(batches)
        loss_sum = start_sum(local_loss_sum, trainer.loss_mesh)
        params = [p for part in trainer.model_parts for p in part.parameters()]
        match_grad_placements(params)
        grad_norm = clip_grad_norm_(params, trainer.cfg.training.max_norm)
        self.lr = trainer.optimizer.param_groups[0]["lr"]
        syncs_before = self.manager.current_step()
        trainer.optimizer.step()  # torchft's post-step hook syncs here when due (and may heal this group)
        self._after_inner_step(trainer, syncs_before)
        trainer.lr_scheduler.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        loss = loss_sum() / scale.global_tokens
        trainer.check_finite(loss)
        return loss, float(grad_norm)

    def _after_inner_step(self, trainer: Trainer, syncs_before: int) -> None:
        self.synced = False
        if semi_sync_local_step(self.semi.algo) != 0:
            return  # no sync at this step
        if self.manager.current_step() > syncs_before:  # committed (a heal also moved it to the peer's count)
            self.synced = True
            self.syncs += 1
            self.participants = self.manager.num_participants()
            self._maybe_check_replicas(trainer)
            return
        self.discarded += 1
        logger.warning("Fault tolerance: the sync at step %d was discarded (%s); the reference parameters are kept",
                       trainer.step, self.manager.errored() or "too few live groups")

    def _maybe_check_replicas(self, trainer: Trainer) -> None:
        """Every ``replica_check_freq`` syncs: the groups compare their reference parameters and outer momentum
        (LocalSGD: the weights), which a sync makes bitwise equal; inner optimizer states differ by design."""
        ft = trainer.cfg.fault_tolerance
        step = self.manager.current_step()
        if not ft.replica_check_freq or step % ft.replica_check_freq:
            return
        tensors = self.semi.reference_tensors() or [p for part in trainer.model_parts for p in part.parameters()]
        check_replicas(self.manager, ft.replica_id, ft.num_replica_groups, fingerprint(tensors), trainer.step)
