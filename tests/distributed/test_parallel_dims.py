"""ParallelDims: the validation table, and real 8-rank meshes with their flattened views."""

from __future__ import annotations

import itertools
import math

import pytest
import torch.distributed as dist
from dist_harness import run_ranks

from torchtitan.distributed import FLATTENED_VIEWS, ParallelDims

ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@pytest.mark.parametrize(
    "degrees, world, expected_shard",
    [
        ((1, -1, 1, 1, 1), 8, 8),
        ((2, -1, 1, 1, 1), 8, 4),
        ((2, 1, 1, 1, 1), 2, 1),
        ((1, -1, 1, 2, 1), 8, 4),
        ((2, 2, 2, 1, 1), 8, 2),
        ((1, -1, 1, 1, 1), 1, 1),
        ((1, 1, 1, 2, 2), 4, 1),
        ((1, -1, 2, 2, 2), 8, 1),
    ],
)
def test_valid_degrees(degrees, world, expected_shard):
    dp_replicate, dp_shard, cp, tp, pp = degrees
    dims = ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, pp=pp, world_size=world)
    assert dims.dp_shard == expected_shard
    assert dims.dp_replicate * dims.dp_shard * dims.cp * dims.tp * dims.pp == world


@pytest.mark.parametrize(
    "degrees, world, needle",
    [
        ((0, -1, 1, 1, 1), 8, "dp_replicate=0"),
        ((1, 0, 1, 1, 1), 8, "dp_shard=0"),
        ((1, -2, 1, 1, 1), 8, "dp_shard=-2"),
        ((1, -1, -1, 1, 1), 8, "cp=-1"),
        ((1, -1, 1, 0, 1), 8, "tp=0"),
        ((1, -1, 1, 1, -1), 8, "pp=-1"),
        ((1, -1, 1, 3, 1), 8, "divisible by dp_replicate*cp*tp*pp=3"),
        ((2, 2, 1, 1, 1), 8, "= 4 but world_size = 8"),
        ((1, 4, 1, 2, 2), 8, "= 16 but world_size = 8"),
        ((1, 1, 1, 1, 1), 0, "world_size must be >= 1"),
    ],
)
def test_invalid_degrees_raise_value_error_with_fix(degrees, world, needle):
    dp_replicate, dp_shard, cp, tp, pp = degrees
    with pytest.raises(ValueError) as info:
        ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, pp=pp, world_size=world)
    message = str(info.value)
    assert needle in message
    assert f"world_size={world}" in message  # the degrees and world size are always named


def test_enabled_properties():
    dims = ParallelDims(dp_replicate=2, dp_shard=2, cp=1, tp=2, pp=1, world_size=8)
    assert dims.dp_enabled and dims.dp_replicate_enabled and dims.dp_shard_enabled and dims.fsdp_enabled
    assert dims.tp_enabled and dims.loss_parallel_enabled
    assert not dims.cp_enabled and not dims.pp_enabled
    assert dims.non_data_parallel_size == 2
    ddp = ParallelDims(dp_replicate=8, dp_shard=1, cp=1, tp=1, pp=1, world_size=8)
    assert ddp.dp_enabled and not ddp.fsdp_enabled and not ddp.dp_shard_enabled
    cp_only = ParallelDims(dp_replicate=1, dp_shard=1, cp=2, tp=1, pp=1, world_size=2)
    assert cp_only.fsdp_enabled and not cp_only.dp_enabled


# name: (pp, dp_replicate, dp_shard, cp, tp)
LAYOUTS = {
    "fsdp8": (1, 1, 8, 1, 1),
    "hsdp2x4": (1, 2, 4, 1, 1),
    "ddp8": (1, 8, 1, 1, 1),
    "tp2_fsdp4": (1, 1, 4, 1, 2),
    "pp2_hsdp2x2": (2, 2, 2, 1, 1),
    "cp2_tp2_fsdp2": (1, 1, 2, 2, 2),
    "pp2_tp2_cp2": (2, 1, 1, 2, 2),
}


def _describe_meshes(rank: int, world_size: int, layouts: dict) -> dict:
    out = {}
    for name, (pp, rep, shard, cp, tp) in layouts.items():
        dims = ParallelDims(dp_replicate=rep, dp_shard=shard, cp=cp, tp=tp, pp=pp, world_size=world_size)
        mesh = dims.build_mesh("cpu")
        views = {}
        for view in (*ORDER, *FLATTENED_VIEWS):
            sub = dims.get_mesh(view)
            views[view] = None if sub is None else (sub.get_local_rank(), sub.size(),
                                                    dist.get_process_group_ranks(sub.get_group()))
        fsdp = dims.fsdp_mesh()
        out[name] = {
            "names": mesh.mesh_dim_names,
            "shape": tuple(mesh.shape),
            "views": views,
            "fsdp": None if fsdp is None else (fsdp.mesh_dim_names, tuple(fsdp.shape)),
        }
    return out


def _expected_view(rank: int, sizes: dict[str, int], view_dims: tuple[str, ...]):
    """Reference: the group of ranks sharing every coordinate outside ``view_dims``."""
    enabled = [d for d in ORDER if sizes[d] > 1]
    dims_in = [d for d in view_dims if d in enabled]
    if not dims_in:
        return None
    shape = [sizes[d] for d in enabled]
    coords = dict(zip(enabled, _unravel(rank, shape)))
    group = []
    for combo in itertools.product(*[range(sizes[d]) for d in dims_in]):
        c = {**coords, **dict(zip(dims_in, combo))}
        group.append(_ravel([c[d] for d in enabled], shape))
    local = _ravel([coords[d] for d in dims_in], [sizes[d] for d in dims_in])
    return local, math.prod(sizes[d] for d in dims_in), sorted(group)


def _unravel(index: int, shape: list[int]) -> list[int]:
    out = []
    for size in reversed(shape):
        out.append(index % size)
        index //= size
    return list(reversed(out))


def _ravel(coords: list[int], shape: list[int]) -> int:
    index = 0
    for c, s in zip(coords, shape):
        index = index * s + c
    return index


@pytest.mark.slow
def test_meshes_on_eight_ranks():
    results = run_ranks(_describe_meshes, 8, LAYOUTS)
    for name, degrees in LAYOUTS.items():
        sizes = dict(zip(ORDER, degrees))
        enabled = tuple(d for d in ORDER if sizes[d] > 1)
        for rank, per_rank in enumerate(results):
            got = per_rank[name]
            assert got["names"] == enabled, name
            assert got["shape"] == tuple(sizes[d] for d in enabled), name
            for view in ORDER:
                assert got["views"][view] == _expected_view(rank, sizes, (view,)), (name, view, rank)
            for view, dims in FLATTENED_VIEWS.items():
                assert got["views"][view] == _expected_view(rank, sizes, dims), (name, view, rank)
    # FSDP's mesh: 1-D for FSDP, (replicate, shard) for HSDP and for DDP (shard of size 1).
    assert results[0]["fsdp8"]["fsdp"] == (("dp_shard",), (8,))
    assert results[0]["hsdp2x4"]["fsdp"] == (("dp_replicate", "dp_shard"), (2, 4))
    assert results[0]["ddp8"]["fsdp"] == (("dp_replicate", "dp_shard"), (8, 1))
    assert results[0]["cp2_tp2_fsdp2"]["fsdp"] == (("dp_shard_cp",), (4,))
    assert results[0]["pp2_hsdp2x2"]["fsdp"] == (("dp_replicate", "dp_shard"), (2, 2))
    assert results[0]["pp2_tp2_cp2"]["fsdp"] == (("cp",), (2,))
    assert results[0]["tp2_fsdp4"]["views"]["dp"][1] == 4  # dp resolves under FSDP-only
    assert results[0]["ddp8"]["views"]["dp"][1] == 8  # ... and under DDP-only


@pytest.mark.slow
def test_world_size_one():
    (result,) = run_ranks(_describe_meshes, 1, {"single": (1, 1, 1, 1, 1)})
    got = result["single"]
    assert got["names"] == ("dp_shard",) and got["shape"] == (1,)
    assert got["views"]["dp"] == (0, 1, [0])
    assert got["fsdp"] is None
