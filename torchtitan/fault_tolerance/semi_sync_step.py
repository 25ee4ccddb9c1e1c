"""The step protocol of a replica group under DiLoCo or LocalSGD (``semi_sync_method``).

    refresh the heal state -> forward/backward (FSDP inside the group only) -> the group's
    loss -> clip -> inner optimizer step; every sync_steps / num_fragments steps torchft's
    hook on that step syncs (quorum, heal, average, should_commit, outer step) -> LR step

Every inner step counts; only syncs are torchft steps (quorum and commit). The loss and
gradient norm are the group's own (its tokens, its local weights): there is no cross-group
collective between syncs, so no global loss exists there. Nothing is read on the host
between syncs; a sync's quorum and commit vote are torchft's, inside the optimizer step.
"""

from __future__ import annotations

import logging
from typing import Any

from torchtitan.batch import Batch
from torchtitan.compat import semi_sync_local_step
from torchtitan.config.job_config import FaultTolerance
from torchtitan.distributed.collectives import start_sum
from torchtitan.fault_tolerance.data import GroupPosition, RepositionableBatches
from torchtitan.fault_tolerance.manager_protocol import FTManager
from torchtitan.fault_tolerance.replica_check import check_replicas, fingerprint
from torchtitan.fault_tolerance.semi_sync import SemiSyncState
from torchtitan.fault_tolerance.state import HealState
from torchtitan.fault_tolerance.step import FaultTolerantStep
from torchtitan.train_step.base import StepOutput, StepParts

logger = logging.getLogger(__name__)


class SemiSyncStep(FaultTolerantStep):
    """Runs a trainer's steps as DiLoCo/LocalSGD inner steps; torchft's hooks on the optimizer sync."""

    def __init__(self, parts: StepParts, manager: FTManager, state: HealState, position: GroupPosition,
                 ft_cfg: FaultTolerance,
                 semi_sync_state: SemiSyncState):
        super().__init__(parts, manager, state, position, ft_cfg)
        self.semi_sync_state = semi_sync_state
        self.syncs = 0  # committed syncs of this process (tests and logs)
        self.synced = False  # whether the last step ended with a committed sync
        self.started_at = 0  # the step training began after: 0, or a loaded checkpoint's
        self._syncs_before = 0  # torchft's step (the syncs) before this step's optimizer step

    def start(self, step: int) -> RepositionableBatches:
        """Begin after ``step``: torchft's step (the syncs) comes from the checkpoint's semi-sync state, if any.

        Without it (a fresh start, or a checkpoint of another mode) the current weights become the
        reference and the sync count starts at 0, so a group behind its peers heals at its first sync.
        """
        self.started_at = step
        if not self.semi_sync_state.loaded:
            self.semi_sync_state.restart_from_weights()
            self.manager.load_state_dict({"step": 0, "batches_committed": 0})
        return self.position.start()

    def checkpoint_states(self) -> dict[str, Any]:
        return {"semi_sync": self.semi_sync_state}

    def writes_checkpoint(self) -> bool:
        """Whether this group writes the job's checkpoint now: the first group of its last sync's quorum.

        Before this process has committed a sync, only group 0 of a fresh start writes: its
        weights up to the first sync depend on nothing but its own seed and data. A group that
        resumed from a checkpoint, or came back while others trained on, trains apart until
        its next sync: its save would replace the job's checkpoint of that step with its own state.
        """
        if self.syncs:
            return self.manager.participating_rank() == 0
        return self.replica_id == 0 and self.started_at == 0

    def _run(self, batches: list[Batch], step: int) -> StepOutput:
        """One inner step over ``batches`` (and a sync when due); the loss and grad norm are this group's."""
        self.position.step = step
        self.state.refresh()  # what a peer healing at this step's sync receives
        scale = self.local_scale(batches)  # inner steps average over the group's own tokens
        local_loss_sum = self.forward_backward(batches, scale, self.reduce_on_last(batches))
        out = self.finish(step, start_sum(local_loss_sum, self.parts.loss_mesh), scale)
        assert out is not None  # no vote here: a sync commits (or not) inside the optimizer step
        return out

    # ---- the tail's hooks: torchft's hook on the optimizer step syncs when due (and may heal this group)
    def commit(self) -> bool:
        return True

    def before_optimizer_step(self) -> None:
        self._syncs_before = self.manager.current_step()

    def after_optimizer_step(self) -> None:
        self.synced = False
        if semi_sync_local_step(self.semi_sync_state.algo) != 0:
            return  # no sync at this step
        if self.manager.current_step() > self._syncs_before:  # committed (a heal also moved it to the peer's count)
            self.synced = True
            self.syncs += 1
            self.participants = self.manager.num_participants()
            self._maybe_check_replicas()
            return
        self.discarded += 1
        logger.warning("Fault tolerance: the sync at step %d was discarded (%s); the reference parameters are kept",
                       self.position.step, self.manager.errored() or "too few live groups")

    def after_step(self) -> None:
        """The replica check runs after a committed sync (``after_optimizer_step``), not every step."""

    def _maybe_check_replicas(self) -> None:
        """Every ``replica_check_freq`` syncs: the groups compare their reference parameters and outer momentum
        (LocalSGD: the weights), which a sync makes bitwise equal; inner optimizer states differ by design."""
        syncs = self.manager.current_step()
        if not self.replica_check_freq or syncs % self.replica_check_freq:
            return
        tensors = self.semi_sync_state.reference_tensors() or [
            p for part in self.parts.model_parts for p in part.parameters()]
        check_replicas(self.manager, self.replica_id, self.num_replica_groups, fingerprint(tensors),
                       self.position.step)
