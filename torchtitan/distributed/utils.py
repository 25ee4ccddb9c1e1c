"""Process-group set-up and the few collectives the trainer needs."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import socket
import time
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


def _store_barrier(name: str, timeout: timedelta) -> None:
    """Wait until every rank of the default group got here, through the store, not a collective.

    A collective here could pair up with a collective that a peer is still stuck in; the
    store cannot. The rank hosting the store (rank 0 without torchrun's agent) waits until
    every rank has seen the barrier open, so that no rank is left asking a store that is gone.
    """
    store = dist.distributed_c10d._get_default_store()
    world = dist.get_world_size()
    # torchrun keeps its store across restarts of the workers: one key per attempt.
    key = f"torchtitan/{name}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if store.add(f"{key}/arrived", 1) == world:
        store.set(f"{key}/open", "1")
    store.wait([f"{key}/open"], timeout)
    left = store.add(f"{key}/left", 1)
    if dist.get_rank() == 0:
        deadline = time.monotonic() + timeout.total_seconds()
        while left < world and time.monotonic() < deadline:
            time.sleep(0.01)
            left = store.add(f"{key}/left", 0)


def shutdown_distributed(ok: bool, timeout_seconds: float) -> bool:
    """The last thing a rank does: meet the others (on success), then destroy every process group.

    On success every rank waits, at most ``timeout_seconds``, until all ranks have finished
    (their final save and metrics closed), so that no rank tears its connections down while
    a peer still talks to it. Then every group is destroyed and collected while the
    interpreter is fully alive: a gloo group left to the interpreter's own exit can take
    the process down with SIGABRT ("terminate called without an active exception") when
    its threads' last references go after Python's teardown has begun.

    After a failure (``ok=False``) nothing waits for the peers, which may be stuck in a
    collective this rank never joins; gloo groups are still destroyed (closing their
    connections fails the peers' collectives at once), NCCL ones are not (destroying a
    communicator while a peer uses it can block), and the launcher stops the rest.
    Returns whether there was a process group to leave.
    """
    if not dist.is_initialized():
        return False
    if ok and dist.get_world_size() > 1:
        try:
            _store_barrier("shutdown", timedelta(seconds=timeout_seconds))
        except RuntimeError as e:  # a timeout or a lost store (DistStoreError): leave anyway
            logging.getLogger(__name__).warning(
                "Shutdown: not every rank finished within %.0f s (%s); leaving anyway", timeout_seconds, e)
    if ok or "nccl" not in str(dist.get_backend()):
        dist.destroy_process_group()
    gc.collect()  # the groups' last references go now, not during the interpreter's exit
    return True


def set_collective_timeout(seconds: int) -> int:
    """Shorten the collective timeout of every process group this process belongs to; return how many.

    Called once the slow first step is done, so that a dead or hung rank ends the job.
    "Every group" is every group created so far, not only the root mesh's dims: the
    flattened views (FSDP's ``dp_shard_cp``, the loss sums' ``dp_cp``), the unit-shard
    mesh of DDP/TP layouts and the checkpoint group hang just as well as the default one.
    """
    timeout = timedelta(seconds=seconds)
    groups = list(dist.distributed_c10d._world.pg_map)
    for group in groups:
        dist.distributed_c10d._set_pg_timeout(timeout, group)
    return len(groups)


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
