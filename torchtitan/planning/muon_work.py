"""Muon's owners seen from the whole job: every rank's Newton-Schulz work, its imbalance, and the naive layout.

A dry run simulates one rank of each mesh, so its step records only that rank's share of the owners' work
(``optim/muon_owners.py``). The other ranks' shares come from the owner plan that every rank computes alike at
build (``OwnerUpdate.plans``: each matrix's owner and the whole it orthogonalizes), with each whole's
Newton-Schulz FLOPs counted by running Muon's own ``orthogonalized`` on a fake tensor of its shape under the
planner's op counter (``compute.py``): no formula of Muon's is written here. The step waits for the slowest
owner, so the cost model prices the most loaded rank's Newton-Schulz work (``cost.py``).

The naive layout (every rank gathers the whole of every matrix it holds a block of and orthogonalizes it) is
priced from the same plan: every whole's FLOPs on every rank, and an all-gather of each whole over the mesh dims
that cut it, innermost first as the owners' gathers go, with no scatter and no replica broadcast.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from torchtitan.compat import FakeTensorMode, TorchDispatchMode
from torchtitan.optim.muon import Muon, MuonSettings, orthogonalized
from torchtitan.optim.muon_owners import OwnerUpdate, ShardedMatrix
from torchtitan.planning.compute import ComputeLedger


@dataclass
class MuonOwnerWork:
    """One step's Newton-Schulz FLOPs by rank, as the owner plan of the simulated rank's matrices gives them."""

    own_flops: int  # the simulated rank's (its step records the same)
    max_flops: int  # the most loaded owner's: the step waits for it
    mean_flops: float  # over the ranks the owners are chosen among
    ranks: int  # how many those are
    naive_flops: int  # each rank in the naive layout: every matrix it holds a block of, whole
    # the naive layout's all-gathers: mesh dim -> (bytes, count) per rank
    naive_gathers: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def imbalance(self) -> float:
        """The most loaded owner's Newton-Schulz work over the mean (1: balanced)."""
        return self.max_flops / self.mean_flops if self.mean_flops else 1.0


class _MatmulCounter(TorchDispatchMode):
    """Counts each op's work in a ``ComputeLedger`` (the dry run's counter) as it runs."""

    def __init__(self, ledger: ComputeLedger):
        super().__init__()
        self.ledger = ledger

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ledger.on_op(func, args, kwargs, out)
        return out


def newton_schulz_flops(shape: tuple[int, ...], row_parts: tuple[int, ...], settings: MuonSettings) -> int:
    """Matmul FLOPs of Muon's ``orthogonalized`` on a whole of ``shape``, counted on a fake tensor."""
    ledger = ComputeLedger(phase="optimizer", recording=True)
    with FakeTensorMode(), _MatmulCounter(ledger):
        orthogonalized(torch.empty(shape), row_parts, settings)
    return ledger.work["optimizer"].matmul_flops


def owner_work(optimizer: torch.optim.Optimizer, dim_of_group: dict[str, str]) -> MuonOwnerWork | None:
    """This rank's view of every owner's Newton-Schulz work (None unless ``optimizer`` is Muon by owners).

    Call it in the simulated rank's process group, outside any fake-tensor mode; ``dim_of_group`` names each
    process group's mesh dim as the traffic ledger does.
    """
    if not isinstance(optimizer, Muon) or not isinstance(optimizer.orthogonalize, OwnerUpdate):
        return None
    settings, flops_of = optimizer.settings, {}
    loads: dict[int, int] = defaultdict(int)
    plain = naive = 0
    gathers: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for group in optimizer.param_groups:
        if not group["use_muon"]:
            continue
        for p in group["params"]:
            plan = optimizer.orthogonalize.plans.get(p)
            shape = tuple(plan.whole_shape if plan is not None else p.shape)
            key = (shape, optimizer.row_parts.get(p, ()))
            if key not in flops_of:
                flops_of[key] = newton_schulz_flops(*key, settings)
            naive += flops_of[key]
            if plan is None:  # a plain tensor: every rank orthogonalizes it
                plain += flops_of[key]
                continue
            for rank in _owner_ranks(plan):
                loads[rank] += flops_of[key]
            for dim, nbytes in _naive_gathers(plan, p.element_size(), dim_of_group):
                gathers[dim][0] += nbytes
                gathers[dim][1] += 1
    everyone = _ranks_of_meshes(optimizer.orthogonalize)
    per_rank = [loads.get(r, 0) + plain for r in everyone]
    return MuonOwnerWork(own_flops=loads.get(dist.get_rank(), 0) + plain, max_flops=max(per_rank),
                         mean_flops=sum(per_rank) / len(per_rank), ranks=len(per_rank), naive_flops=naive,
                         naive_gathers={d: (b, c) for d, (b, c) in gathers.items()})


def _owner_ranks(plan: ShardedMatrix) -> list[int]:
    """The global ranks that orthogonalize ``plan``'s whole: the owner, and along an expert dim every rank (each
    holding its own experts, as many as this rank's)."""
    index = tuple(slice(None) if c == -1 else c for c in plan.owner)
    return plan.mesh.mesh[index].flatten().tolist()


def _ranks_of_meshes(update: OwnerUpdate) -> list[int]:
    """Every rank the owners are chosen among: those of the meshes of this rank's sharded matrices."""
    return sorted({r for plan in update.plans.values() for r in plan.mesh.mesh.flatten().tolist()})


def _naive_gathers(plan: ShardedMatrix, element_size: int, dim_of_group: dict[str, str]) -> list[tuple[str, int]]:
    """The naive layout's all-gathers of one matrix: (dim, gathered bytes) over each cut dim, innermost first."""
    out, blocks = [], 1
    for d in plan.cut_mesh_dims[::-1]:
        blocks *= plan.mesh.size(d)
        group = plan.mesh.get_group(d)
        out.append((dim_of_group.get(group.group_name, "other"), plan.padded_numel() * blocks * element_size))
    return out

