"""Dispatch and autograd-engine internals: an op's name and schema, a storage's identity, and whether a
backward pass is running."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch._ops import OpOverload

from typing import TYPE_CHECKING

import torch

from torchtitan.compat.errors import missing

if TYPE_CHECKING:
    pass


def op_name(func: OpOverload) -> str:
    """An ``OpOverload``'s op name without namespace or overload (``mm`` for ``aten.mm.default``)."""
    if not hasattr(func, "_opname"):
        raise missing("OpOverload._opname")
    return func._opname


def op_schema(func: OpOverload) -> torch.FunctionSchema:
    """An ``OpOverload``'s schema: its arguments (with what each may write) and its returns."""
    if not hasattr(func, "_schema"):
        raise missing("OpOverload._schema")
    return func._schema


def storage_id(storage: torch.UntypedStorage) -> int:
    """An id of the storage itself, the same for every tensor that views it (fake storages too)."""
    if not hasattr(storage, "_cdata"):
        raise missing("UntypedStorage._cdata")
    return storage._cdata


def in_autograd_backward() -> bool:
    """Whether this thread runs inside an autograd backward pass now."""
    if not hasattr(torch._C, "_current_graph_task_id"):
        raise missing("torch._C._current_graph_task_id")
    return torch._C._current_graph_task_id() != -1

def in_backward_pass() -> bool:
    """Whether the autograd engine is running a backward pass on this thread right now.

    Activation checkpointing recomputes a forward inside the backward pass (reentrant or not),
    while the original forward runs outside it, with grad mode on or off; so this, and not
    ``torch.is_grad_enabled()``, tells a recompute from the original forward.
    """
    if not hasattr(torch._C, "_current_graph_task_id"):
        raise missing("torch._C._current_graph_task_id")
    return torch._C._current_graph_task_id() != -1
