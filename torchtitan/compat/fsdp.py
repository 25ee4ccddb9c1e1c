"""FSDP2 internals: a unit's parameter groups, the parameters its all-reduce hook sees, and hooks on the
storages it resizes (the planner's memory ledger)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from torchtitan.compat.errors import missing

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule


def fsdp_param_groups(unit: FSDPModule) -> list[Any]:
    """The parameter groups (``FSDPParamGroup``) of one ``fully_shard`` unit."""
    if not hasattr(unit, "_get_fsdp_state"):
        raise missing("FSDPModule._get_fsdp_state")
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)  # torch >= 2.13: a list per unit
    if groups is None:
        if not hasattr(state, "_fsdp_param_group"):  # torch 2.11/2.12: one group or None
            raise missing("FSDPState._fsdp_param_groups or FSDPState._fsdp_param_group")
        groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
    return list(groups)


def fsdp_hooked_parameters(unit: FSDPModule) -> list[torch.Tensor]:
    """The sharded parameters of ``unit`` whose reduced gradients its all-reduce hook sees."""
    hooked: list[torch.Tensor] = []
    for group in fsdp_param_groups(unit):
        if not hasattr(group, "_all_reduce_hook") or not hasattr(group, "fsdp_params"):
            raise missing("FSDPParamGroup._all_reduce_hook / FSDPParamGroup.fsdp_params")
        if group._all_reduce_hook is not None:
            hooked.extend(fsdp_param.sharded_param for fsdp_param in group.fsdp_params)
    return hooked


@contextlib.contextmanager
def fsdp_storage_hooks(on_resize: Callable[[torch.Tensor], None],
                       on_accumulated_grad: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Within it, FSDP2 calls ``on_resize(t)`` after it allocates or frees an unsharded parameter's storage,
    and ``on_accumulated_grad(g)`` after it keeps an unsharded gradient ``g`` between backwards.

    FSDP2 resizes those storages in place, which no op shows a dispatch mode; without gradient sync
    it keeps each unsharded gradient, in the reduce dtype, until the step's one reduce-scatter.
    Patched: the module functions ``_fsdp_param.alloc_storage``/``free_storage`` (and the
    ``_fsdp_param_group`` module's own binding of ``alloc_storage``) and two ``FSDPParam`` methods.
    """
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group
    except ImportError as e:
        raise missing("torch.distributed.fsdp._fully_shard._fsdp_param / _fsdp_param_group") from e
    cls = getattr(_fsdp_param, "FSDPParam", None)
    for owner, name in ((_fsdp_param, "alloc_storage"), (_fsdp_param, "free_storage"),
                        (_fsdp_param_group, "alloc_storage"), (cls, "to_accumulated_grad_if_needed"),
                        (cls, "accumulate_unsharded_grad_if_needed")):
        if not hasattr(owner, name):
            raise missing(f"torch.distributed.fsdp._fully_shard.{getattr(owner, '__name__', owner)}.{name}")
    assert cls is not None  # the checks above raised otherwise
    alloc, free = _fsdp_param.alloc_storage, _fsdp_param.free_storage
    to_accumulated, accumulate = cls.to_accumulated_grad_if_needed, cls.accumulate_unsharded_grad_if_needed

    def alloc_and_note(tensor: torch.Tensor) -> None:
        alloc(tensor)
        on_resize(tensor)

    def free_and_note(tensor: torch.Tensor) -> None:
        free(tensor)
        on_resize(tensor)

    def note_accumulated(method: Callable[[Any], None]) -> Callable[[Any], None]:
        def wrapper(self: Any) -> None:
            method(self)
            if self.unsharded_accumulated_grad is not None:
                on_accumulated_grad(self.unsharded_accumulated_grad)
        return wrapper

    # _fsdp_param_group's own binding of alloc_storage (an import, not its export) must be patched too.
    patches: list[tuple[object, str, object]] = [
        (_fsdp_param, "alloc_storage", alloc_and_note), (_fsdp_param_group, "alloc_storage", alloc_and_note),
        (_fsdp_param, "free_storage", free_and_note),
        (cls, "to_accumulated_grad_if_needed", note_accumulated(to_accumulated)),
        (cls, "accumulate_unsharded_grad_if_needed", note_accumulated(accumulate))]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in originals:
            setattr(owner, name, value)
