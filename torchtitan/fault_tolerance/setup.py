"""Build the step strategy of one replica group of a fault-tolerant job."""

from __future__ import annotations

import logging

import torch

from torchtitan.config.job_config import FaultTolerance
from torchtitan.fault_tolerance.data import GroupPosition
from torchtitan.fault_tolerance.hooks import install_cross_group_hooks
from torchtitan.fault_tolerance.manager import build_manager
from torchtitan.fault_tolerance.manager_protocol import FTManager
from torchtitan.fault_tolerance.semi_sync import SemiSyncState, build_semi_sync
from torchtitan.fault_tolerance.semi_sync_step import SemiSyncStep
from torchtitan.fault_tolerance.state import HealState, init_optimizer_state
from torchtitan.fault_tolerance.step import FaultTolerantStep
from torchtitan.train_step.base import StepParts

logger = logging.getLogger(__name__)


def build_fault_tolerant_step(ft: FaultTolerance, parts: StepParts, device: torch.device) -> FaultTolerantStep:
    """Create the optimizer's state, the heal state, the manager and the hooks (or DiLoCo/LocalSGD); return the step."""
    init_optimizer_state(parts.optimizer)
    assert parts.dataloader is not None, "only the planner's dry run has no dataloader, and it runs no torchft"
    position = GroupPosition(parts.dataloader)
    state = HealState(parts.model_parts, parts.optimizer, parts.lr_scheduler,
                      trainer_state=position.state, load_trainer_state=position.load)
    manager = build_manager(ft, state, device)
    if ft.semi_sync_method != "none":
        return SemiSyncStep(parts, manager, state, position, ft, _semi_sync_state(ft, parts, manager))
    units = install_cross_group_hooks(parts.model_parts, manager)
    logger.info("Fault tolerance: cross-group all-reduce hooked into %d FSDP unit(s)", units)
    return FaultTolerantStep(parts, manager, state, position, ft)


def _semi_sync_state(ft: FaultTolerance, parts: StepParts, manager: FTManager) -> SemiSyncState:
    """torchft's DiLoCo/LocalSGD on the inner optimizer, entered (its hooks on it); no per-step hooks."""
    algo, fragments, outers = build_semi_sync(ft, manager, parts.model_parts, parts.optimizer)
    logger.info("Fault tolerance: %s, a sync every %d step(s) over %d fragment(s) of %s parameters each",
                ft.semi_sync_method, ft.sync_steps // len(fragments), len(fragments),
                "/".join(f"{sum(p.numel() for p in f.parameters()):,}" for f in fragments))
    return SemiSyncState(algo, parts.model_parts, fragments, outers, manager)
