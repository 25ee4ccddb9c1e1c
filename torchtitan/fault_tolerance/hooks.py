"""The cross-group gradient all-reduce, hooked into every FSDP unit.

Inside a group FSDP reduce-scatters over its own (gloo/NCCL) mesh; the hook then averages
each unit's reduced shard over the live groups through torchft. A parameter outside every
hooked unit would keep its group's own gradient and the groups would silently drift apart,
so ``check_every_parameter_hooked`` refuses to train then.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule

from torchtitan.compat import fsdp_hooked_parameters
from torchtitan.fault_tolerance.manager_protocol import FTManager


def fsdp_units(model_parts: list[torch.nn.Module]) -> list[FSDPModule]:
    return [m for part in model_parts for m in part.modules() if isinstance(m, FSDPModule)]


def install_cross_group_hooks(model_parts: list[torch.nn.Module], manager: FTManager) -> int:
    """Average every FSDP unit's reduced gradient over the live groups; return the number of units hooked."""

    def all_reduce_across_groups(reduced: torch.Tensor) -> None:
        # AVG over the participants; a healing group sends zeros and receives the others' mean.
        # A failure is recorded by the manager and makes should_commit() discard the step.
        manager.allreduce(reduced).wait()

    units = fsdp_units(model_parts)
    for unit in units:
        unit.set_all_reduce_hook(all_reduce_across_groups)
    check_every_parameter_hooked(model_parts)
    return len(units)


def check_every_parameter_hooked(model_parts: list[torch.nn.Module]) -> None:
    """Raise naming the parameters whose gradients no cross-group hook would reduce."""
    hooked: set[int] = set()
    for unit in fsdp_units(model_parts):
        hooked.update(id(p) for p in fsdp_hooked_parameters(unit))
    missing = [name for part in model_parts for name, p in part.named_parameters() if id(p) not in hooked]
    if missing:
        raise RuntimeError(
            f"fault tolerance: {len(missing)} parameter(s) sit in no FSDP unit with the cross-group all-reduce "
            f"hook ({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}); their groups would drift apart. "
            "FSDP must wrap every parameter in fault-tolerant mode (distributed/parallelize.py does so)."
        )


def set_gradient_sync(model_parts: list[torch.nn.Module], enabled: bool) -> None:
    """Let FSDP reduce (and so the hook run) only on a step's last micro-batch: one cross-group all-reduce per step."""
    for part in model_parts:
        if isinstance(part, FSDPModule):
            part.set_requires_gradient_sync(enabled)
