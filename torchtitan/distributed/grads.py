"""Gradient helpers of the optimizer step: placements fixed once per step, then clipping by the global norm."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from torchtitan.compat import REDISTRIBUTE_LOGGER

# DTensor warns on every step that reducing a norm partial over (dp_shard, tp) takes two
# all-reduces instead of one; for one scalar per mesh that costs nothing worth a warning.
_REDISTRIBUTE_LOG = logging.getLogger(REDISTRIBUTE_LOGGER)


@contextlib.contextmanager
def _quiet(log: logging.Logger):
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


@torch.no_grad()
def match_grad_placements(parameters: Iterable[torch.nn.Parameter]) -> None:
    """Give every DTensor gradient its parameter's placements (once per step, before clipping).

    Without FSDP, autograd leaves two kinds of tensor-parallel gradient in a placement other
    than their parameter's: a norm weight that sequence parallelism replicates gets a
    ``Partial`` gradient (each rank summed over its own tokens), and the row-sharded embedding
    gets a ``Replicate`` one (the whole vocabulary on every rank). Left so, the grad norm and
    every AdamW op would redistribute them again (4 all-reduces per norm per step) and every
    rank would keep the whole embedding gradient. FSDP does the same conversion itself
    before its reduce-scatter, so under FSDP this finds nothing to do.
    """
    for p in parameters:
        grad = p.grad
        if isinstance(grad, DTensor) and isinstance(p, DTensor) and grad.placements != p.placements:
            p.grad = grad.redistribute(p.device_mesh, p.placements)


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.nn.Parameter],
    max_norm: float,
    pp_mesh: DeviceMesh | None = None,
    norm_type: float = 2.0,
    uncounted: Iterable[torch.nn.Parameter] = (),
) -> torch.Tensor:
    """Clip gradients to ``max_norm`` by their true global norm; return that norm.

    A DTensor gradient's norm is partial over the mesh it is sharded on
    (FSDP, HSDP, TP); ``full_tensor()`` finishes that reduction. Pipeline stages
    hold disjoint parameters, so their squared norms are summed across ``pp`` too.
    ``max_norm <= 0`` only measures. ``uncounted``: parameters clipped but left out of the norm (a second stage's
    copy of a parameter another stage counts: distributed/stage_copies.py).
    """
    parameters = [p for p in parameters if p.grad is not None]
    skip = {id(p) for p in uncounted}
    # DTensor ops need one mesh: under TP without sequence parallelism the norm weights
    # live on the FSDP mesh alone and the linear weights on (FSDP, TP). Take each mesh's
    # norm, finish its reduction, then combine the per-mesh norms.
    by_mesh: dict[object, list[torch.nn.Parameter]] = {}
    for p in parameters:
        by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    norms = []
    for group in by_mesh.values():
        grads = [p.grad for p in group if p.grad is not None and id(p) not in skip]  # None: filtered above
        if not grads:
            continue
        # torch 2.13 already redistributes inside get_total_norm (the norm of the per-tensor norms), so
        # the quiet covers both calls.
        with _quiet(_REDISTRIBUTE_LOG):
            norm = torch.nn.utils.get_total_norm(grads, norm_type=norm_type, foreach=True)
            if isinstance(norm, DTensor):
                norm = norm.full_tensor()
        norms.append(norm)
    total = torch.nn.utils.get_total_norm(norms, norm_type=norm_type) if norms else torch.zeros(())
    if pp_mesh is not None and pp_mesh.size() > 1:
        if norm_type == float("inf"):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pp_mesh.get_group())
        else:
            total = total**norm_type
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_mesh.get_group())
            total = total ** (1.0 / norm_type)
    if max_norm > 0:
        for group in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return total
