"""Per-rank seeding that follows the parallel layout, with no communication.

Ranks that hold *different* shards or layers (TP, FSDP, CP, PP) must draw different
random numbers; ranks that hold *replicas* (DDP, the replicate dim of HSDP) must
draw the same ones. This rank's seed is therefore

    seed + offset,  offset = row-major index of this rank over the sharded dims,

taken in the order the user lists them, the first most significant. Ranks that
differ only in unlisted dims get the same offset, hence the same seed.

Everything is computed from the coordinates each rank already knows (a mesh's, or
``ParallelDims``'s over every axis of the layout, ``ep`` included): no broadcast and no
other collective, so it can never hang and it never replaces the user's seed with rank 0's.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.compat import install_dtensor_rng_tracker
from torchtitan.distributed.parallel_dims import AXES, ParallelDims

logger = logging.getLogger(__name__)


def sharded_offset(coords: Sequence[int], sizes: Sequence[int]) -> int:
    """Row-major index of ``coords`` in a grid of ``sizes`` (first most significant)."""
    offset = 0
    for coord, size in zip(coords, sizes):
        offset = offset * size + coord
    return offset


def sharded_dims_problem(sharded_dims: Sequence[str], known: Sequence[str] = AXES) -> str | None:
    """What is wrong with a list of sharded dims (names among ``known``, each once), or None."""
    unknown = [d for d in sharded_dims if d not in known]
    if unknown:
        return f"unknown dim(s) {', '.join(unknown)}; choose from {', '.join(known)}"
    if len(set(sharded_dims)) != len(sharded_dims):
        return "a dim is listed twice"
    return None


def _mesh_coords(mesh: DeviceMesh, sharded_dims: Sequence[str]) -> tuple[list[int], list[int]]:
    own = list(mesh.mesh_dim_names or ())
    problem = sharded_dims_problem(sharded_dims, known=[*own, *(d for d in AXES if d not in own)])
    if problem:
        raise ValueError(f"manual_seed: sharded_dims {list(sharded_dims)}: {problem}")
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError("manual_seed: this rank is not part of the given mesh")
    coords, sizes = [], []
    for name in sharded_dims:
        if name not in own:
            continue  # a disabled (size-1) dim adds nothing to the offset
        i = own.index(name)
        coords.append(coordinate[i])
        sizes.append(mesh.size(i))
    return coords, sizes


def _layout_coords(dims: ParallelDims, sharded_dims: Sequence[str]) -> tuple[list[int], list[int]]:
    problem = sharded_dims_problem(sharded_dims, known=[name for name, _ in dims.axes()])
    if problem:
        raise ValueError(f"manual_seed: sharded_dims {list(sharded_dims)}: {problem}")
    coords, sizes = [], []
    for name in sharded_dims:
        coord, size = dims.rank_and_size(name)  # (0, 1) on a degree-1 axis: it adds nothing to the offset
        coords.append(coord)
        sizes.append(size)
    return coords, sizes


def _group_coords(groups: Sequence[dist.ProcessGroup]) -> tuple[list[int], list[int]]:
    rank = dist.get_rank()
    coords, sizes = [], []
    for group in groups:
        group_rank = dist.get_group_rank(group, rank)
        if group_rank < 0:
            raise ValueError(f"manual_seed: rank {rank} is not a member of one of the sharded groups")
        coords.append(group_rank)
        sizes.append(dist.get_world_size(group))
    return coords, sizes


def manual_seed(
    seed: int,
    *,
    mesh: DeviceMesh | None = None,
    sharded_dims: Sequence[str] | None = None,
    sharded_groups: Sequence[dist.ProcessGroup] | None = None,
    dims: ParallelDims | None = None,
) -> int:
    """Seed Python, torch (CPU and accelerator) for this rank and return the seed used.

    Give either ``sharded_dims`` (names of ``mesh`` dims, or of ``dims``'s axes: a built
    ``ParallelDims`` in place of the mesh) or ``sharded_groups`` (process groups, e.g.
    ``mesh.get_group("tp")``); an empty list seeds every rank with ``seed``. The returned
    seed is ``seed + offset`` (see the module docstring).
    """
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"manual_seed: seed must be an int, got {seed!r}")
    if (sharded_dims is None) == (sharded_groups is None):
        raise ValueError("manual_seed: give exactly one of sharded_dims (with a mesh) or sharded_groups")
    if mesh is not None and dims is not None:
        raise ValueError("manual_seed: give the mesh or the ParallelDims, not both")
    if dims is not None:
        mesh = dims.world_mesh
    if sharded_dims is not None:
        if mesh is None:
            raise ValueError("manual_seed: sharded_dims needs the mesh they name")
        coords, sizes = (_layout_coords(dims, list(sharded_dims)) if dims is not None
                         else _mesh_coords(mesh, list(sharded_dims)))
    else:
        assert sharded_groups is not None  # exactly one of the two is given, checked above
        coords, sizes = _group_coords(list(sharded_groups))

    rank_seed = seed + sharded_offset(coords, sizes)
    random.seed(rank_seed)
    torch.manual_seed(rank_seed)  # CPU and every accelerator device
    _seed_numpy(rank_seed)
    if mesh is not None:
        _set_dtensor_rng(rank_seed, mesh)
    return rank_seed


def _seed_numpy(seed: int) -> None:
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed(seed % 2**32)


def _set_dtensor_rng(seed: int, mesh: DeviceMesh) -> None:
    """Install DTensor's RNG tracker ourselves, without its state sync.

    DTensor creates its tracker lazily on the first random op, and that default
    tracker broadcasts rank 0's seed over the mesh: a collective behind the user's
    back that would erase the per-rank seeds. Creating it here with
    ``run_state_sync=False`` keeps our seeds. DTensor has a tracker only for
    accelerators; on CPU it uses the plain torch generator we just seeded.
    """
    if install_dtensor_rng_tracker(mesh):
        torch.manual_seed(seed)


def set_determinism(deterministic: bool) -> None:
    """Deterministic algorithms, plus the CUDA settings they need."""
    if not deterministic:
        return
    import os

    # cuBLAS needs a fixed workspace to be deterministic; it must be set before its first use.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    # Flash/memory-efficient SDPA backward kernels are not deterministic on CUDA.
    if torch.cuda.is_available():
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
