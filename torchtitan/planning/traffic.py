"""Every collective a dry-run step issues, recorded from the fake process group, grouped by mesh dim.

The dry run's dispatch mode hands each collective op to ``TrafficLedger.on_op``. Its process group
names the mesh dim it runs over (``dim_of_groups`` maps every group the mesh built), and its bytes
per rank are those of the rank's buffer:

- all-gather: the gathered output; reduce-scatter: the unreduced input; all-reduce, broadcast,
  send and recv: the tensor; gather and scatter: the larger of the rank's own block and the blocks it
  holds for the group (the root's: every block); all-to-all: the larger of what the rank sends and receives (the
  expert-parallel exchange is uneven when routing is: a link carries both directions at once, so the
  busier one sets its time).

Whether a group stays in a node or crosses the network depends on the cluster's GPUs per node, so
the ledger keeps each group's global ranks and ``crosses_nodes`` decides for a given node size.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from torchtitan.compat import c10d_op, functional_collective_ops, resolve_process_group
from torchtitan.distributed.group_labels import extra_group_labels
from torchtitan.distributed.parallel_dims import ParallelDims

c10d, functional = torch.ops.c10d, functional_collective_ops()

# op -> (kind, where its process group is in args, how its bytes are read)
# Byte readers: "arg0", "arg1" (a tensor or a list of tensors at that position), "out" (the result);
# a tuple of them: the largest.
_OPS: dict = {
    c10d_op("_allgather_base_"): ("all_gather", 2, "arg0"),
    c10d.allgather_.default: ("all_gather", 2, "arg0"),
    c10d.allgather_into_tensor_coalesced_.default: ("all_gather", 2, "arg0"),
    c10d_op("_reduce_scatter_base_"): ("reduce_scatter", 2, "arg1"),
    c10d.reduce_scatter_.default: ("reduce_scatter", 2, "arg1"),
    c10d.reduce_scatter_tensor_coalesced_.default: ("reduce_scatter", 2, "arg1"),
    c10d.allreduce_.default: ("all_reduce", 1, "arg0"),
    c10d.allreduce_coalesced_.default: ("all_reduce", 1, "arg0"),
    c10d.broadcast_.default: ("broadcast", 1, "arg0"),
    # Muon's owner gathers and scatters (optim/muon_owners.py): the owner's buffer holds every block.
    c10d.gather_.default: ("gather", 2, ("arg0", "arg1")),
    c10d.scatter_.default: ("scatter", 2, ("arg0", "arg1")),
    c10d.send.default: ("send", 1, "arg0"),
    c10d.recv_.default: ("recv", 1, "arg0"),
    c10d.alltoall_base_.default: ("all_to_all", 2, ("arg0", "arg1")),
    functional.all_gather_into_tensor.default: ("all_gather", "name2", "out"),
    functional.all_gather_into_tensor_coalesced.default: ("all_gather", "name2", "out"),
    functional.reduce_scatter_tensor.default: ("reduce_scatter", "name3", "arg0"),
    functional.reduce_scatter_tensor_coalesced.default: ("reduce_scatter", "name3", "arg0"),
    functional.all_reduce.default: ("all_reduce", "name2", "arg0"),
    functional.all_reduce_.default: ("all_reduce", "name2", "arg0"),
    functional.all_reduce_coalesced.default: ("all_reduce", "name2", "arg0"),
    functional.broadcast.default: ("broadcast", "name2", "arg0"),
    functional.all_to_all_single.default: ("all_to_all", "name3", ("arg0", "out")),
}
COLLECTIVE_OPS = frozenset(_OPS)


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(v) for v in x)
    return 0


def _read(reader: str, args, out) -> int:
    return _nbytes(out) if reader == "out" else _nbytes(args[int(reader[-1])])


def _group(func, args, where) -> dist.ProcessGroup:
    if isinstance(where, int):
        return dist.ProcessGroup.unbox(args[where])
    return resolve_process_group(args[int(where[-1])])


@dataclass
class CollectiveStats:
    count: int = 0
    bytes: int = 0  # per rank, summed over the step


@dataclass(frozen=True)
class Cover:
    """One asynchronous collective and the work that ran between its issue and the wait on its output (``work``:
    a ``PhaseWork`` as a tuple): what hides it. ``key``: its row's (dim, kind, phase, via)."""

    key: tuple[str, str, str, str]
    nbytes: int
    work: tuple[int, ...]


@dataclass
class TrafficLedger:
    """Collectives by (mesh dim, kind, phase), with each dim's group ranks.

    ``covers``: the asynchronous all-to-alls (the experts' dispatch with ``--moe.overlap_all_to_all``) with work
    between their issue and their wait, by how many such there were; ``last``: the row and bytes of the collective
    ``on_op`` recorded last (the recorder opens a cover there).
    """

    dim_of_group: dict[str, str]
    phase: str = "build"
    stats: dict[tuple[str, str, str, str], CollectiveStats] = field(
        default_factory=lambda: defaultdict(CollectiveStats))
    group_ranks: dict[str, list[int]] = field(default_factory=dict)  # dim -> the global ranks of this rank's group
    recording: bool = False
    covers: dict[Cover, int] = field(default_factory=lambda: defaultdict(int))
    last: tuple[tuple[str, str, str, str], int] | None = None

    def on_op(self, func, args, out) -> bool:
        """Record ``func`` if it is a collective; True when it was one."""
        spec = _OPS.get(func)
        if spec is None:
            return False
        if not self.recording:
            return True
        kind, where, reader = spec
        group = _group(func, args, where)
        dim = self.dim_of_group.get(group.group_name, "other")
        if dim not in self.group_ranks:
            self.group_ranks[dim] = dist.get_process_group_ranks(group)
        nbytes = max(_read(r, args, out) for r in (reader if isinstance(reader, tuple) else (reader,)))
        # FSDP2 and the pipeline call c10d directly; DTensor (TP, loss parallel, clipping) and CP go
        # through functional collectives. The cost model overlaps the first kind with compute.
        source = "c10d" if func.namespace == "c10d" else "functional"
        s = self.stats[(dim, kind, self.phase, source)]
        s.count += 1
        s.bytes += nbytes
        self.last = ((dim, kind, self.phase, source), nbytes)
        return True

    def covered(self, key: tuple[str, str, str, str], nbytes: int, work: tuple[int, ...]) -> None:
        """The collective of row ``key`` (``nbytes``) ran beside ``work`` (a ``PhaseWork`` tuple)."""
        self.covers[Cover(key, nbytes, work)] += 1

    def by_dim(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for (dim, _, _, _), s in self.stats.items():
            out[dim] += s.bytes
        return dict(out)

    def rows(self) -> list[dict]:
        return [{"dim": d, "kind": k, "phase": p, "via": v, "count": s.count, "bytes": s.bytes}
                for (d, k, p, v), s in sorted(self.stats.items())]


def crosses_nodes(ranks: list[int], gpus_per_node: int) -> bool:
    """True when the group's ranks sit on more than one node (ranks are placed on nodes in order)."""
    return len({r // gpus_per_node for r in ranks}) > 1


def dim_of_groups(dims: ParallelDims) -> dict[str, str]:
    """Process-group name -> the mesh dim (or flattened view) it belongs to, for every mesh of ``dims``."""
    names = dims.group_labels()
    world = dist.group.WORLD
    assert world is not None, "the planner runs inside an initialized process group"
    names.setdefault(world.group_name, "world")
    return {**extra_group_labels(), **names}
