"""Muon on sharded matrices: each one orthogonalized once, by its owner rank (docs/muon.md).

FSDP2 keeps a matrix as row blocks (a DTensor sharded on one dimension of its mesh, replicated on
HSDP's other one). Orthogonalizing needs the whole matrix, so every matrix gets one owner among its
mesh's ranks, chosen by a longest-processing-time heap over the Newton-Schulz cost ``m·n·min(m, n)``
(deterministic: every rank computes the same owners). In the owner's replica the shard ranks gather
their momentum blocks onto the owner, the owner orthogonalizes, and scatters the update's blocks back;
HSDP's other replicas receive their blocks by a broadcast from the owner's replica. The result is the
one-process update, computed on one rank instead of all of them.

Expert weights ``[E, m, n]`` cut on E (FSDP over experts, expert parallelism, or both: ``_StridedShard``)
hold whole matrices on each rank: the ranks along those mesh dimensions orthogonalize their own experts
with no communication; only a cut of their rows (FSDP2's ``Shard(1)``) or a replica dimension is handled
as above.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from torchtitan.compat.mesh import local_shape_and_global_offset
from torchtitan.optim.muon import MuonSettings, orthogonalized


@dataclass(frozen=True)
class ShardedMatrix:
    """Where one sharded Muon parameter lives and who orthogonalizes it."""

    mesh: DeviceMesh
    shard_mesh_dim: int | None  # the mesh dimension whose ranks hold its blocks (None: replicated only)
    tensor_dim: int  # the tensor dimension cut into blocks
    replicate_mesh_dim: int | None  # HSDP's replica dimension
    owner: tuple[int, ...]  # the owner's coordinate on the mesh; -1 on an expert dimension: every rank there
    full_shape: torch.Size
    expert_mesh_dims: tuple[int, ...] = ()  # mesh dimensions that cut a 3-D weight's experts (dim 0)

    def block_rows(self) -> int:
        """FSDP2 cuts like ``torch.chunk``: blocks of ceil(d / S) rows, the last ones shorter or empty."""
        if self.shard_mesh_dim is None:
            return self.full_shape[self.tensor_dim]
        return math.ceil(self.full_shape[self.tensor_dim] / self.mesh.size(self.shard_mesh_dim))


def newton_schulz_cost(shape: torch.Size, row_parts: tuple[int, ...]) -> int:
    """Multiply-adds of one Newton-Schulz step on every matrix of ``shape`` (ns_steps scales them all alike)."""
    batch = math.prod(shape[:-2])
    cols = shape[-1]
    return batch * sum(m * cols * min(m, cols) for m in (row_parts or (shape[-2],)))


def assign_owners(costs: list[int], candidates: list[list[int]]) -> list[int]:
    """Each item's owner among its candidate ranks: the most costly item first, to the least loaded rank
    (ties to the lower rank, then the earlier item), so every rank computes the same answer."""
    load: dict[int, int] = {}
    owners = [-1] * len(costs)
    for _, index in sorted((-cost, i) for i, cost in enumerate(costs)):
        heap = [(load.get(rank, 0), rank) for rank in candidates[index]]
        heapq.heapify(heap)
        _, rank = heap[0]
        owners[index] = rank
        load[rank] = load.get(rank, 0) + costs[index]
    return owners


def _expert_dims(placements: tuple, ndim: int) -> tuple[int, ...]:
    """The mesh dimensions that cut the experts (dim 0) of a 3-D weight: each rank holds whole matrices."""
    return tuple(d for d, p in enumerate(placements)
                 if ndim >= 3 and isinstance(p, (Shard, _StridedShard)) and p.dim == 0)


def _layout_problem(placements: tuple, ndim: int) -> str | None:
    experts = _expert_dims(placements, ndim)
    cuts = [p for d, p in enumerate(placements) if isinstance(p, Shard) and d not in experts]
    replicas = [p for p in placements if isinstance(p, Replicate)]
    if len(experts) + len(cuts) + len(replicas) != len(placements) or any(type(p) is not Shard for p in cuts):
        return "only Shard and Replicate placements are supported (no partial sums, no strided cut of rows)"
    if len(cuts) > 1 or len(replicas) > 1:
        return "at most one mesh dimension cutting each matrix and one replicating it are supported (FSDP, HSDP, EP)"
    return None


class OwnerUpdate:
    """The distributed ``Orthogonalize`` of ``Muon``: plans the owners of ``params`` once, at build.

    ``names`` name the parameters in the one-line refusal of a layout it cannot handle.
    ``owned_last_step`` lists what this rank orthogonalized in its last call: ``(name, first, stop)``, the
    experts ``first <= e < stop`` of a 3-D weight, ``0, 1`` for a 2-D one.
    """

    def __init__(self, params: list[torch.Tensor], names: dict[torch.Tensor, str],
                 row_parts: dict[torch.Tensor, tuple[int, ...]]) -> None:
        self.names = names
        self.plans: dict[torch.Tensor, ShardedMatrix] = {}
        sharded = [p for p in params if isinstance(p, DTensor)]
        candidates = []
        for p in sharded:
            problem = _layout_problem(tuple(p.placements), p.ndim)
            if problem:
                raise ValueError(f"optimizer.name=Muon: parameter {names.get(p, tuple(p.shape))} has placements "
                                 f"{tuple(p.placements)}: {problem}")
            candidates.append(_representative_ranks(p))
        costs = [newton_schulz_cost(p.shape, row_parts.get(p, ())) for p in sharded]
        for p, owner in zip(sharded, assign_owners(costs, candidates)):
            self.plans[p] = _plan(p, owner)
        self.owned_last_step: list[tuple[str, int, int]] = []

    def __call__(self, params: list[torch.Tensor], updates: list[torch.Tensor], settings: MuonSettings,
                 row_parts: list[tuple[int, ...]]) -> list[torch.Tensor]:
        self.owned_last_step = []
        results: list[torch.Tensor | None] = [None] * len(params)
        gathered = {}
        waits = []
        for i, p in enumerate(params):
            plan = self.plans.get(p)
            if plan is None:  # a plain tensor: whole on every rank
                results[i] = orthogonalized(updates[i], row_parts[i], settings)
                self.owned_last_step.append((self.names.get(p, str(i)), 0, math.prod(p.shape[:-2])))
            elif _in_owner_replica(plan):
                gathered[i], work = _gather(plan, updates[i])
                waits.append(work)
        _wait(waits)
        blocks = {}
        for i, p in enumerate(params):
            plan = self.plans.get(p)
            if plan is None or not _in_owner_replica(plan):
                continue
            full = None
            if _is_owner(plan):
                whole = gathered[i][0]
                if plan.shard_mesh_dim is not None:
                    whole = torch.cat(gathered[i], dim=plan.tensor_dim)
                    whole = whole.narrow(plan.tensor_dim, 0, plan.full_shape[plan.tensor_dim])
                full = orthogonalized(whole, row_parts[i], settings)
                self.owned_last_step.append(_matrices_of(self.names.get(p, str(i)), p, plan))
            blocks[i], work = _scatter(plan, full, updates[i])
            waits.append(work)
        _wait(waits)
        for i, p in enumerate(params):
            plan = self.plans.get(p)
            if plan is None:
                continue
            if i not in blocks:
                blocks[i] = torch.empty_like(updates[i])
            if plan.replicate_mesh_dim is not None:
                waits.append(dist.broadcast(blocks[i], group=plan.mesh.get_group(plan.replicate_mesh_dim),
                                            group_src=plan.owner[plan.replicate_mesh_dim], async_op=True))
            results[i] = blocks[i]
        _wait(waits)
        return [r for r in results if r is not None]


def _representative_ranks(p: DTensor) -> list[int]:
    """The ranks among which ``p``'s owner is chosen: on expert dimensions only the first slice (every slice
    chooses alike, and every rank computes the same loads)."""
    ranks = p.device_mesh.mesh
    for d in sorted(_expert_dims(tuple(p.placements), p.ndim), reverse=True):
        ranks = ranks.select(d, 0).unsqueeze(d)
    return ranks.flatten().tolist()


def _plan(p: DTensor, owner_rank: int) -> ShardedMatrix:
    placements = tuple(p.placements)
    experts = _expert_dims(placements, p.ndim)
    cut_dims = [d for d, pl in enumerate(placements) if isinstance(pl, Shard) and d not in experts]
    replicate_dims = [d for d, pl in enumerate(placements) if isinstance(pl, Replicate)]
    mesh = p.device_mesh
    owner = [int(c) for c in (mesh.mesh == owner_rank).nonzero()[0].tolist()]
    for d in experts:
        owner[d] = -1
    shard_mesh_dim = cut_dims[0] if cut_dims else None
    tensor_dim = placements[shard_mesh_dim].dim if shard_mesh_dim is not None else 0  # type: ignore[union-attr]
    return ShardedMatrix(mesh, shard_mesh_dim, tensor_dim, replicate_dims[0] if replicate_dims else None,
                         tuple(owner), p.shape, experts)


def _matrices_of(name: str, p: torch.Tensor, plan: ShardedMatrix) -> tuple[str, int, int]:
    """The experts (or the one 2-D matrix) that this owner orthogonalizes of ``p``."""
    if not plan.expert_mesh_dims or not isinstance(p, DTensor):
        return name, 0, math.prod(p.shape[:-2])
    shape, offset = local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return name, offset[0], offset[0] + shape[0]


def _coordinate(plan: ShardedMatrix) -> tuple[int, ...]:
    coordinate = plan.mesh.get_coordinate()
    assert coordinate is not None, "a rank holding a DTensor is on its mesh"
    return tuple(coordinate)


def _in_owner_replica(plan: ShardedMatrix) -> bool:
    r = plan.replicate_mesh_dim
    return r is None or _coordinate(plan)[r] == plan.owner[r]


def _is_owner(plan: ShardedMatrix) -> bool:
    return all(owner in (-1, mine) for owner, mine in zip(plan.owner, _coordinate(plan)))


def _padded(block: torch.Tensor, dim: int, rows: int) -> torch.Tensor:
    if block.size(dim) == rows:
        return block.contiguous()
    shape = list(block.shape)
    shape[dim] = rows - block.size(dim)
    return torch.cat([block, block.new_zeros(shape)], dim=dim)


def _gather(plan: ShardedMatrix, block: torch.Tensor) -> tuple[list[torch.Tensor], dist.Work | None]:
    """This rank's block onto the owner (the owner's list fills with every block, padded alike)."""
    if plan.shard_mesh_dim is None:
        return [block], None
    rows = plan.block_rows()
    mine = _padded(block, plan.tensor_dim, rows)
    blocks = [torch.empty_like(mine) for _ in range(plan.mesh.size(plan.shard_mesh_dim))] if _is_owner(plan) else []
    work = dist.gather(mine, blocks if _is_owner(plan) else None, group=plan.mesh.get_group(plan.shard_mesh_dim),
                       group_dst=plan.owner[plan.shard_mesh_dim], async_op=True)
    return blocks, work


def _scatter(plan: ShardedMatrix, full: torch.Tensor | None, block: torch.Tensor
             ) -> tuple[torch.Tensor, dist.Work | None]:
    """The owner's update cut back into blocks; this rank's block (its shape) is the result."""
    if plan.shard_mesh_dim is None:
        return (full if full is not None else torch.empty_like(block)), None
    rows, ranks = plan.block_rows(), plan.mesh.size(plan.shard_mesh_dim)
    received = _padded(torch.empty_like(block), plan.tensor_dim, rows)
    pieces = None
    if full is not None:
        padded = _padded(full, plan.tensor_dim, rows * ranks)
        pieces = [piece.contiguous() for piece in padded.split(rows, dim=plan.tensor_dim)]
    work = dist.scatter(received, pieces, group=plan.mesh.get_group(plan.shard_mesh_dim),
                        group_src=plan.owner[plan.shard_mesh_dim], async_op=True)
    return received.narrow(plan.tensor_dim, 0, block.size(plan.tensor_dim)), work


def _wait(works: list[dist.Work | None]) -> None:
    for work in works:
        if work is not None:
            work.wait()
    works.clear()
