"""Muon on sharded matrices: each one orthogonalized once, by its owner rank (docs/optimizers.md).

FSDP2 and TP keep a matrix as blocks (a DTensor cut on one or more dimensions of its mesh: FSDP's rows,
TP's rows or columns; replicated on HSDP's). Orthogonalizing needs the whole matrix, so every matrix gets
one owner among its mesh's ranks, chosen by a longest-processing-time heap over the Newton-Schulz cost
``m·n·min(m, n)`` (deterministic: every rank computes the same owners). In the owner's replica the blocks
travel to the owner one cut mesh dimension at a time (a gather per dimension, over its existing process
group), the owner places each at its global offset, orthogonalizes the whole, and the update's blocks go
back the same way (scatters); the other replicas receive their blocks by a broadcast from the owner's
replica. The result is the one-process update, computed on one rank instead of all of them.

Expert weights ``[E, m, n]`` cut on E (FSDP over experts, expert parallelism, or both: ``_StridedShard``)
hold whole matrices on each rank: the ranks along those mesh dimensions orthogonalize their own experts
with no communication; only a cut of their rows (FSDP2's ``Shard(1)``) or a replica dimension is handled
as above.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from torchtitan.compat.mesh import local_shape_and_global_offset, shard_dim
from torchtitan.optim.muon import MuonSettings, orthogonalized

Box = tuple[tuple[int, ...], tuple[int, ...]]  # a block's shape and its global offset


@dataclass(frozen=True)
class ShardedMatrix:
    """Where one sharded Muon parameter lives and who orthogonalizes it (as this rank sees it)."""

    mesh: DeviceMesh
    cut_mesh_dims: tuple[int, ...]  # the mesh dimensions whose ranks hold blocks of the same matrices (FSDP, TP)
    replicate_mesh_dims: tuple[int, ...]  # HSDP's replica dimension (or a TP dimension replicating the weight)
    owner: tuple[int, ...]  # the owner's coordinate on the mesh; -1 on an expert dimension: every rank there
    expert_mesh_dims: tuple[int, ...]  # mesh dimensions that cut a 3-D weight's experts (dim 0)
    boxes: tuple[Box, ...]  # the blocks of the cut ranks, row-major over cut_mesh_dims (this rank's experts)
    origin: tuple[int, ...]  # where the whole of those blocks starts in the parameter
    whole_shape: tuple[int, ...]  # the shape of the whole they tile: the full matrices this owner orthogonalizes

    def padded_numel(self) -> int:
        """Every block travels flat, padded to the largest one, so each gather and scatter is uniform."""
        return max(math.prod(shape) for shape, _ in self.boxes)


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
                 if ndim >= 3 and shard_dim(p) == 0)


def _layout_problem(placements: tuple, ndim: int) -> str | None:
    if any(shard_dim(p) is None and not isinstance(p, Replicate) for p in placements):
        return "only Shard and Replicate placements are supported (no partial sums)"
    return None


class OwnerUpdate:
    """The distributed ``Orthogonalize`` of ``Muon``: plans the owners of ``params`` once, at build.

    ``names`` name the parameters in the one-line refusal of a layout it cannot handle.
    ``owned_last_step`` lists what this rank orthogonalized in its last call: ``(name, first, stop)``, the
    experts ``first <= e < stop`` of a 3-D weight, ``0, 1`` for a 2-D one; ``overlapped_last_step`` counts
    those it orthogonalized while some of its gathers or scatters were still travelling.
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
            self.plans[p] = _plan(p, owner, names.get(p, str(tuple(p.shape))))
        self.owned_last_step: list[tuple[str, int, int]] = []
        self.overlapped_last_step = 0

    def __call__(self, params: list[torch.Tensor], updates: list[torch.Tensor], settings: MuonSettings,
                 row_parts: list[tuple[int, ...]]) -> list[torch.Tensor]:
        self.owned_last_step, self.overlapped_last_step = [], 0
        sharded = {i: self.plans[p] for i, p in enumerate(params) if p in self.plans}
        traffic = _Traffic(sharded, updates)
        results: dict[int, torch.Tensor] = {}

        def finish(i: int) -> None:
            """Orthogonalize matrix ``i`` if this rank owns it, then send its blocks back (async)."""
            plan = sharded[i]
            if _is_owner(plan):
                self.overlapped_last_step += traffic.in_flight() > 0
                full = orthogonalized(_assembled(plan, traffic.held[i]), row_parts[i], settings)
                traffic.held[i] = _flat_blocks(plan, full)
                first = plan.origin[0] if len(plan.whole_shape) > 2 else 0
                self.owned_last_step.append((self.names.get(params[i], str(i)), first,
                                             first + math.prod(plan.whole_shape[:-2])))
            traffic.issue_first_scatter(i)

        for level in range(max((len(plan.cut_mesh_dims) for plan in sharded.values()), default=0) or 1):
            traffic.issue_gathers(level)
            if level == 0:  # what needs no gather is orthogonalized while the first gathers travel
                for i, p in enumerate(params):
                    if i not in sharded:  # a plain tensor: whole on every rank
                        self.overlapped_last_step += traffic.in_flight() > 0
                        results[i] = orthogonalized(updates[i], row_parts[i], settings)
                        self.owned_last_step.append((self.names.get(p, str(i)), 0, math.prod(p.shape[:-2])))
                for i in [i for i, plan in sharded.items() if not plan.cut_mesh_dims]:
                    finish(i)
            for i in traffic.wait_gathers():  # each matrix as soon as its blocks are in, later ones still travel
                finish(i)
        results.update(traffic.finish_scatters())
        _broadcast_to_replicas(sharded, results)
        return [results[i] for i in range(len(params))]


def _canonical_ranks(mesh: DeviceMesh) -> torch.Tensor:
    """``mesh``'s ranks moved to start at 0. A mesh sliced from a larger one (FSDP's data ranks under TP, one
    pipeline stage's) differs between slices by a constant, so every rank that shares a parameter sees the same
    numbers for every other parameter too, and computes the same loads and owners."""
    return mesh.mesh - mesh.mesh.min()


def _representative_ranks(p: DTensor) -> list[int]:
    """The ranks among which ``p``'s owner is chosen: on expert dimensions only the first slice (every slice
    chooses alike, and every rank computes the same loads)."""
    ranks = _canonical_ranks(p.device_mesh)
    for d in sorted(_expert_dims(tuple(p.placements), p.ndim), reverse=True):
        ranks = ranks.select(d, 0).unsqueeze(d)
    return ranks.flatten().tolist()


def _plan(p: DTensor, owner_rank: int, name: str) -> ShardedMatrix:
    placements = tuple(p.placements)
    experts = _expert_dims(placements, p.ndim)
    cut = tuple(d for d, pl in enumerate(placements) if not isinstance(pl, Replicate) and d not in experts)
    replicas = tuple(d for d, pl in enumerate(placements) if isinstance(pl, Replicate))
    mesh = p.device_mesh
    owner = [int(c) for c in (_canonical_ranks(mesh) == owner_rank).nonzero()[0].tolist()]
    for d in experts:
        owner[d] = -1
    mine = mesh.get_coordinate()
    assert mine is not None, "a rank holding a DTensor is on its mesh"
    boxes = []
    for cut_coordinate in itertools.product(*(range(mesh.size(d)) for d in cut)):
        coordinate = list(mine)
        for d, c in zip(cut, cut_coordinate):
            coordinate[d] = c
        boxes.append(local_shape_and_global_offset(p.shape, mesh, placements, coordinate))
    origin, whole = _tiled_whole(boxes)
    if origin is None:
        raise ValueError(f"optimizer.name=Muon: parameter {name} has placements {placements} whose blocks do not "
                         "tile one box of it; shard it with Shard/Replicate on whole rows or columns")
    return ShardedMatrix(mesh, cut, replicas, tuple(owner), experts, tuple(boxes), origin, whole)


def _tiled_whole(boxes: list[Box]) -> tuple[tuple[int, ...] | None, tuple[int, ...]]:
    """The box the blocks tile exactly (their origin and shape), or ``(None, ())`` when they overlap or leave a
    hole: the owner assembles the whole from each block's offset."""
    filled = [(shape, offset) for shape, offset in boxes if math.prod(shape)]
    if not filled:
        return tuple(0 for _ in boxes[0][0]), tuple(0 for _ in boxes[0][0])
    origin = tuple(min(o[d] for _, o in filled) for d in range(len(filled[0][0])))
    end = tuple(max(o[d] + s[d] for s, o in filled) for d in range(len(filled[0][0])))
    whole = tuple(e - o for e, o in zip(end, origin))

    if _is_grid(filled, origin, end):
        return origin, whole

    def overlap(a: Box, b: Box) -> bool:
        return all(max(a[1][d], b[1][d]) < min(a[1][d] + a[0][d], b[1][d] + b[0][d]) for d in range(len(whole)))

    # Not a grid: every pair compared (quadratic, but only for placements no shipped layout makes).
    disjoint = not any(overlap(a, b) for a, b in itertools.combinations(filled, 2))
    if not disjoint or sum(math.prod(s) for s, _ in filled) != math.prod(whole):
        return None, ()
    return origin, whole


def _is_grid(filled: list[Box], origin: tuple[int, ...], end: tuple[int, ...]) -> bool:
    """Whether the blocks are each once the product of one partition of every dimension, which tiles the box
    exactly. Shard placements always cut this way (each mesh dimension cuts whole rows or columns), and the check
    is linear in the blocks, where comparing every pair took about a second a matrix at 1,024 blocks."""
    cuts = 1
    for d in range(len(origin)):
        intervals = sorted({(o[d], o[d] + s[d]) for s, o in filled})
        contiguous = all(a[1] == b[0] for a, b in zip(intervals, intervals[1:]))
        if not contiguous or intervals[0][0] != origin[d] or intervals[-1][1] != end[d]:
            return False
        cuts *= len(intervals)
    # Every block is one cell of the product of those partitions; as many distinct blocks as cells: each cell once.
    return len(set(filled)) == len(filled) == cuts


def _coordinate(plan: ShardedMatrix) -> tuple[int, ...]:
    coordinate = plan.mesh.get_coordinate()
    assert coordinate is not None, "a rank holding a DTensor is on its mesh"
    return tuple(coordinate)


def _matches_owner(plan: ShardedMatrix, dims: tuple[int, ...]) -> bool:
    mine = _coordinate(plan)
    return all(mine[d] == plan.owner[d] for d in dims)


def _is_owner(plan: ShardedMatrix) -> bool:
    return _matches_owner(plan, plan.replicate_mesh_dims + plan.cut_mesh_dims)


def _flat_padded(block: torch.Tensor, numel: int) -> torch.Tensor:
    flat = block.reshape(-1)
    return torch.cat([flat, flat.new_zeros(numel - flat.numel())]) if flat.numel() < numel else flat.contiguous()


def _assembled(plan: ShardedMatrix, flat: torch.Tensor) -> torch.Tensor:
    """The whole matrices from every block, laid out flat and padded in the order of ``plan.boxes``."""
    whole = flat.new_empty(plan.whole_shape)
    for (shape, offset), piece in zip(plan.boxes, flat.split(plan.padded_numel())):
        if math.prod(shape):
            _region(whole, plan.origin, shape, offset).copy_(piece[:math.prod(shape)].view(shape))
    return whole


def _flat_blocks(plan: ShardedMatrix, whole: torch.Tensor) -> torch.Tensor:
    """``whole`` cut back into the blocks of ``plan.boxes``, flat and padded, one after the other."""
    numel = plan.padded_numel()
    return torch.cat([_flat_padded(_region(whole, plan.origin, shape, offset), numel) for shape, offset in plan.boxes])


def _region(whole: torch.Tensor, origin: tuple[int, ...], shape: tuple[int, ...], offset: tuple[int, ...]
            ) -> torch.Tensor:
    view = whole
    for d, (size, start) in enumerate(zip(shape, offset)):
        view = view.narrow(d, start - origin[d], size)
    return view


class _Traffic:
    """The owners' gathers and scatters of one step, issued async and waited as late as each matrix allows.

    Gathers go one cut mesh dimension at a time, innermost first: after the level of a dimension the ranks at
    the owner's coordinate on it hold the blocks of the ranks along it. A matrix's first scatter (over its
    outermost cut dimension, the one its last gather used) is issued as soon as its owner has orthogonalized
    it; the scatters over inner dimensions follow once those are in. Every rank issues the collectives of a
    process group in the same order (the loop's, whoever owns what), so gloo's and NCCL's async collectives
    pair up; waiting late only lets the Newton-Schulz math run while the others travel.
    """

    def __init__(self, plans: dict[int, ShardedMatrix], updates: list[torch.Tensor]) -> None:
        self.plans, self.updates = plans, updates
        # the flat blocks this rank holds or will send, by matrix: its own, then what its gathers brought
        self.held = {i: _flat_padded(updates[i], plan.padded_numel()) for i, plan in plans.items()
                     if _matches_owner(plan, plan.replicate_mesh_dims)}
        self.gathers: deque[tuple[int, dist.Work | None, list[torch.Tensor] | None]] = deque()
        self.scatters: list[tuple[int, dist.Work | None, torch.Tensor]] = []
        self.level = 0

    def in_flight(self) -> int:
        """The collectives issued and not yet waited."""
        return len(self.gathers) + len(self.scatters)

    def issue_gathers(self, level: int) -> None:
        self.level = level
        for i, plan in self.plans.items():
            if i not in self.held or level >= len(plan.cut_mesh_dims):
                continue
            dims = plan.cut_mesh_dims[::-1]
            if not _matches_owner(plan, dims[:level]):
                continue
            d = dims[level]
            pieces = None  # what the owner's coordinate on d receives: a block per rank along d
            if _matches_owner(plan, (d,)):
                pieces = [torch.empty_like(self.held[i]) for _ in range(plan.mesh.size(d))]
            self.gathers.append((i, dist.gather(self.held[i], pieces, group=plan.mesh.get_group(d),
                                                group_dst=plan.owner[d], async_op=True), pieces))

    def wait_gathers(self) -> Iterator[int]:
        """Waits this level's gathers in issue order; yields each matrix whose last gather just completed."""
        while self.gathers:
            i, work, pieces = self.gathers.popleft()
            if work is not None:
                work.wait()
            if pieces is not None:
                self.held[i] = torch.cat(pieces)
            if self.level == len(self.plans[i].cut_mesh_dims) - 1:
                yield i

    def issue_first_scatter(self, i: int) -> None:
        if self.plans[i].cut_mesh_dims:
            self._issue_scatter(i, 0)

    def _issue_scatter(self, i: int, level: int) -> None:
        """The owner's blocks of matrix ``i`` over its ``level``-th cut dimension, outermost first (the gather
        reversed); each rank of the owner's replica ends with its block."""
        plan = self.plans[i]
        dims = plan.cut_mesh_dims
        if level >= len(dims) or not _matches_owner(plan, plan.replicate_mesh_dims + dims[level + 1:]):
            return
        d = dims[level]
        pieces = list(self.held[i].chunk(plan.mesh.size(d))) if _matches_owner(plan, (d,)) else None
        received = self.updates[i].new_empty(plan.padded_numel() * math.prod(plan.mesh.size(e)
                                                                              for e in dims[level + 1:]))
        self.scatters.append((i, dist.scatter(received, pieces, group=plan.mesh.get_group(d),
                                              group_src=plan.owner[d], async_op=True), received))

    def finish_scatters(self) -> dict[int, torch.Tensor]:
        """Waits the first scatters, runs the inner ones level by level; each matrix's block of the update (an
        empty one outside the owner's replica, for the broadcast)."""
        for level in itertools.count(1):
            for i, work, received in self.scatters:
                if work is not None:
                    work.wait()
                self.held[i] = received
            self.scatters = []
            if level >= max((len(plan.cut_mesh_dims) for plan in self.plans.values()), default=0):
                break
            for i in self.plans:
                self._issue_scatter(i, level)
        return {i: self.held[i][:u.numel()].view(u.shape) if i in self.held else torch.empty_like(u)
                for i, u in ((i, self.updates[i]) for i in self.plans)}


def _broadcast_to_replicas(plans: dict[int, ShardedMatrix], blocks: dict[int, torch.Tensor]) -> None:
    """The owner replica's blocks to the other replicas, one replicating mesh dimension at a time."""
    for level in range(max((len(plan.replicate_mesh_dims) for plan in plans.values()), default=0)):
        works = []
        for i, plan in plans.items():
            dims = plan.replicate_mesh_dims
            if level < len(dims) and _matches_owner(plan, dims[level + 1:]):
                works.append(dist.broadcast(blocks[i], group=plan.mesh.get_group(dims[level]),
                                            group_src=plan.owner[dims[level]], async_op=True))
        _wait(works)


def _wait(works: list[dist.Work | None]) -> None:
    for work in works:
        if work is not None:
            work.wait()
    works.clear()
