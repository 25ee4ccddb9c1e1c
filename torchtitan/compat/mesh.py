"""DeviceMesh and DTensor internals: splitting and flattening meshes, a shard's shape and offset, a DTensor's
stored shard, and DTensor's RNG tracker."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard

from torchtitan.compat.errors import missing


def unflatten_mesh(mesh: DeviceMesh, sizes: tuple[int, ...], names: tuple[str, ...], fake: tuple[str, ...] = ()
                   ) -> DeviceMesh:
    """``mesh`` (1-D) split into dims ``names`` of ``sizes``, outermost first; a collective on every rank.

    The result shares ``mesh``'s root, so meshes unflattened from one world compose (FSDP2 with TP,
    HSDP) however they split it. The dims named in ``fake`` get the fake backend: no communicator,
    and a collective over them does nothing, so they are for dims no collective runs over.
    """
    if not hasattr(mesh, "_unflatten"):  # with backend_override: torch 2.13 (checked); tests/test_compat.py probes it
        raise missing("DeviceMesh._unflatten")
    override: dict | None = {name: "fake" for name in fake} or None  # torch types the values wider than str
    return mesh._unflatten(0, tuple(sizes), tuple(names), backend_override=override)


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """The dims of ``mesh`` (a slice of a root mesh) as one dim ``name``; a collective on every rank.

    The flattened mesh is kept by its root under ``name``, and its process groups are new ones.
    """
    if not hasattr(mesh, "_flatten"):
        raise missing("DeviceMesh._flatten")
    return mesh._flatten(mesh_dim_name=name)


# DTensor's redistribution logger, whose per-step notes the gradient-norm code quiets.
REDISTRIBUTE_LOGGER = "torch.distributed.tensor._redistribute"


def local_shape_and_global_offset(shape: torch.Size | tuple[int, ...], mesh: DeviceMesh,
                                  placements: Sequence[Placement], coordinate: Sequence[int] | None = None
                                  ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shape of this rank's shard of a global ``shape`` and the global index of its first element;
    of the shard of the rank at ``coordinate`` on ``mesh`` when given (no collective either way)."""
    try:
        from torch.distributed.tensor._utils import (
            _compute_local_shape_and_global_offset,
            compute_local_shape_and_global_offset,
        )
    except ImportError as e:
        raise missing("torch.distributed.tensor._utils.compute_local_shape_and_global_offset") from e
    if coordinate is None:
        return compute_local_shape_and_global_offset(shape, mesh, placements)
    return _compute_local_shape_and_global_offset(shape, mesh.shape, list(coordinate), placements)


def shard_dim(placement: Placement) -> int | None:
    """The tensor dimension ``placement`` cuts: a ``Shard``, or the ``_StridedShard`` FSDP2 writes over TP or EP
    (not a ``Shard`` subclass in torch 2.11 to 2.13); None for a replica or a partial sum."""
    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError as e:
        raise missing("torch.distributed.tensor.placement_types._StridedShard") from e
    if isinstance(placement, (Shard, _StridedShard)):
        return placement.dim
    return None


def dtensor_local(t: DTensor) -> torch.Tensor:
    """A DTensor's local shard as it is stored, without ``to_local``'s autograd op (inside a dispatch mode)."""
    if not hasattr(t, "_local_tensor"):
        raise missing("DTensor._local_tensor")
    return t._local_tensor


def install_dtensor_rng_tracker(mesh: DeviceMesh) -> bool:
    """Give DTensor an RNG tracker for ``mesh`` that keeps each rank's own seed; False where DTensor has none.

    DTensor creates its tracker lazily on the first random op, and that default tracker
    broadcasts rank 0's seed over the mesh. Created here with ``run_state_sync=False`` it
    syncs nothing. DTensor has trackers only for accelerator meshes (CPU uses the plain generator).
    """
    import warnings

    from torch.distributed.tensor import _random

    for name in ("_rng_tracker", "is_rng_supported_mesh", "OffsetBasedRNGTracker"):
        if not hasattr(_random, name):
            raise missing(f"torch.distributed.tensor._random.{name}")
    if mesh.device_type == "cpu":
        return False
    with warnings.catch_warnings():  # it warns, then answers False, for meshes it has no tracker for
        warnings.simplefilter("ignore")
        if not _random.is_rng_supported_mesh(mesh):
            return False
    if _random._rng_tracker is None:
        _random._rng_tracker = _random.OffsetBasedRNGTracker(mesh, run_state_sync=False)
    return True
