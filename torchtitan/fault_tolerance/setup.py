"""Turn a built trainer into one replica group of a fault-tolerant job."""

from __future__ import annotations

import logging

from torchtitan.fault_tolerance.hooks import install_cross_group_hooks
from torchtitan.fault_tolerance.manager import build_manager
from torchtitan.fault_tolerance.semi_sync import SemiSyncState, build_semi_sync
from torchtitan.fault_tolerance.semi_sync_step import SemiSyncStep
from torchtitan.fault_tolerance.state import HealState, init_optimizer_state
from torchtitan.fault_tolerance.step import FaultTolerantStep, Trainer

logger = logging.getLogger(__name__)


def enable_fault_tolerance(trainer: Trainer) -> FaultTolerantStep:
    """Create Adam's state, the heal state, the manager and the hooks; return the step protocol."""
    init_optimizer_state(trainer.optimizer)
    state = HealState(trainer.model_parts, trainer.optimizer, trainer.lr_scheduler,
                      trainer_state=lambda: ft_step.trainer_state(trainer),
                      load_trainer_state=lambda s: ft_step.load_trainer_state(trainer, s))
    manager = build_manager(trainer.cfg, state, trainer.device)
    ft = trainer.cfg.fault_tolerance
    if ft.semi_sync_method != "none":
        ft_step = SemiSyncStep(manager, state, trainer.dataloader)
        _enable_semi_sync(trainer, ft_step)
        return ft_step
    ft_step = FaultTolerantStep(manager, state, trainer.dataloader)
    # The job's checkpoints are written by one live group: the one ranked first in the step's quorum.
    trainer.checkpointer.writes = lambda: manager.participating_rank() == 0
    units = install_cross_group_hooks(trainer.model_parts, manager)
    logger.info("Fault tolerance: cross-group all-reduce hooked into %d FSDP unit(s)", units)
    return ft_step


def _enable_semi_sync(trainer: Trainer, ft_step: SemiSyncStep) -> None:
    """torchft's DiLoCo/LocalSGD on the inner optimizer, its state in the checkpoint; no per-step hooks."""
    ft, manager = trainer.cfg.fault_tolerance, ft_step.manager
    algo, fragments, outers = build_semi_sync(trainer.cfg, manager, trainer.model_parts, trainer.optimizer)
    ft_step.semi = SemiSyncState(algo, trainer.model_parts, fragments, outers, manager)
    trainer.checkpointer.add_state("semi_sync", ft_step.semi)
    trainer.checkpointer.writes = lambda: ft_step.writes_checkpoint(ft.replica_id)
    logger.info("Fault tolerance: %s, a sync every %d step(s) over %d fragment(s) of %s parameters each",
                ft.semi_sync_method, ft.sync_steps // len(fragments), len(fragments),
                "/".join(f"{sum(p.numel() for p in f.parameters()):,}" for f in fragments))
