"""Process-group set-up and the few collectives the trainer needs."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from datetime import timedelta
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


def device_type() -> str:
    """The accelerator when there is one, else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(init_timeout_seconds: int) -> tuple[int, int, torch.device]:
    """Join (or, for a plain ``python train.py``, create) the default process group.

    Returns (rank, world_size, device). CUDA gets NCCL for its tensors plus gloo
    for the occasional CPU tensor; a machine without GPUs gets gloo alone.
    """
    if "RANK" not in os.environ:
        # A single process without torchrun: make a one-rank group so the code path is the same.
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type() == "cuda":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=init_timeout_seconds))
    return dist.get_rank(), dist.get_world_size(), device


def set_collective_timeout(seconds: int, mesh: DeviceMesh | None) -> None:
    """Shorten the collective timeout once the slow first step is done, so a dead rank ends the job."""
    timeout = timedelta(seconds=seconds)
    groups = [None] + (mesh.get_all_groups() if mesh is not None else [])
    for group in groups:
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def reduce_scalar(value: torch.Tensor | float, op: str, mesh: DeviceMesh | None) -> float:
    """Sum, max or mean a scalar over a 1-D mesh (identity when ``mesh`` is None)."""
    tensor = torch.as_tensor(value, dtype=torch.float64)
    if mesh is None or mesh.size() == 1:
        return float(tensor)
    device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" else "cpu"
    tensor = tensor.to(device)
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "mean": dist.ReduceOp.SUM}[op]
    dist.all_reduce(tensor, op=reduce_op, group=mesh.get_group())
    if op == "mean":
        tensor = tensor / mesh.size()
    return float(tensor)


def start_sum(value: torch.Tensor | float, mesh: DeviceMesh | None) -> Callable[[], float]:
    """Start summing a scalar over a 1-D mesh; the returned function waits and gives the sum.

    The trainer starts the token-count and loss sums ahead of work that does not need them
    (the forward; clipping and the optimizer step), so that no rank stops at a blocking
    collective for one number (benchmarks/overhead.py measures this). A CPU value is summed
    on the CPU (gloo), so it never waits for the accelerator; a device value stays there.
    """
    tensor = torch.as_tensor(value, dtype=torch.float64)
    if mesh is None or mesh.size() == 1:
        return lambda: float(tensor)
    tensor = tensor.detach().clone()  # summed in place: never into the caller's tensor
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=mesh.get_group(), async_op=True)

    def finish() -> float:
        work.wait()
        return float(tensor)

    return finish


# DTensor warns on every step that reducing a norm partial over (dp_shard, tp) takes two
# all-reduces instead of one; for one scalar per mesh that costs nothing worth a warning.
_REDISTRIBUTE_LOG = logging.getLogger("torch.distributed.tensor._redistribute")


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
) -> torch.Tensor:
    """Clip gradients to ``max_norm`` by their true global norm; return that norm.

    A DTensor gradient's norm is partial over the mesh it is sharded on
    (FSDP, HSDP, TP); ``full_tensor()`` finishes that reduction. Pipeline stages
    hold disjoint parameters, so their squared norms are summed across ``pp`` too.
    ``max_norm <= 0`` only measures.
    """
    parameters = [p for p in parameters if p.grad is not None]
    # DTensor ops need one mesh: under TP without sequence parallelism the norm weights
    # live on the FSDP mesh alone and the linear weights on (FSDP, TP). Take each mesh's
    # norm, finish its reduction, then combine the per-mesh norms.
    by_mesh: dict[object, list[torch.nn.Parameter]] = {}
    for p in parameters:
        by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type=norm_type, foreach=True)
        if isinstance(norm, DTensor):
            with _quiet(_REDISTRIBUTE_LOG):
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
