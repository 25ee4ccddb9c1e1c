"""A pending collective's result handed to a compiled region with its autograd history (torch.compile x TP)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed._functional_collectives as functional_collectives
from torch.autograd.function import FunctionCtx

from torchtitan.compat.errors import missing

if TYPE_CHECKING:
    from torch.distributed._functional_collectives import AsyncCollectiveTensor


class _WaitKeepingHistory(torch.autograd.Function):
    """The waited value of a pending collective's result, as a node of its autograd graph (gradient: identity)."""

    @staticmethod
    def forward(ctx: FunctionCtx, pending: AsyncCollectiveTensor) -> torch.Tensor:
        done = pending.trigger_wait()
        return done.view_as(done)  # a fresh tensor object: autograd writes its history onto it

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def wait_async_collective(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or where it is a pending collective's result (``AsyncCollectiveTensor``) its waited value
    as a plain tensor that keeps its autograd history.

    Tensor parallelism's output hooks redistribute with ``async_op=True``, so ``to_local()`` hands
    the next module such a tensor. AOTAutograd in torch 2.13 replaces one that reaches a compiled
    region by ``trigger_wait()``, whose result does not require grad, before tracing: the graph is
    then traced as if the input needed no gradient, and backward breaks in DTensor's redistribute
    (docs/versions.md, "torch.compile and tensor parallelism"). Waiting first costs nothing: the
    compiled region waits on entry anyway. A tensor without autograd history is waited plainly.
    """
    pending: type[AsyncCollectiveTensor] | None = getattr(functional_collectives, "AsyncCollectiveTensor", None)
    if pending is None:
        raise missing("torch.distributed._functional_collectives.AsyncCollectiveTensor")
    if not isinstance(tensor, pending):
        return tensor
    if tensor.requires_grad:
        return _WaitKeepingHistory.apply(tensor)
    return tensor.trigger_wait()
