"""The sharded-groups seeding step, on real gloo processes."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks
from torch.distributed.device_mesh import init_device_mesh

from torchtitan.distributed import ParallelDims, manual_seed
from torchtitan.distributed.seeding import sharded_offset

COLLECTIVES = (
    "broadcast", "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "barrier",
    "broadcast_object_list", "all_gather_object", "scatter", "gather", "send", "recv", "reduce", "all_to_all",
)


def _draws() -> tuple[list[float], float]:
    return torch.rand(4).tolist(), random.random()


def _seed_tables(rank: int, world_size: int) -> dict:
    # DDP 2 x PP 2 x TP 2, rank = ddp*4 + pp*2 + tp (the layout the issue states).
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "pp", "tp"))
    out = {}
    for key, dims in {"pp_tp": ["pp", "tp"], "tp_pp": ["tp", "pp"], "none": []}.items():
        out[key] = (manual_seed(123, mesh=mesh, sharded_dims=dims), _draws())
    groups = [mesh.get_group("pp"), mesh.get_group("tp")]
    out["groups_pp_tp"] = (manual_seed(123, sharded_groups=groups), _draws())
    return out


@pytest.mark.slow
def test_two_eight_rank_tables_and_real_draws():
    results = run_ranks(_seed_tables, 8)
    assert [r["pp_tp"][0] for r in results] == [123, 124, 125, 126, 123, 124, 125, 126]
    assert [r["tp_pp"][0] for r in results] == [123, 125, 124, 126, 123, 125, 124, 126]
    assert [r["none"][0] for r in results] == [123] * 8
    assert [r["groups_pp_tp"][0] for r in results] == [r["pp_tp"][0] for r in results]
    for key in ("pp_tp", "tp_pp", "groups_pp_tp"):
        for a in range(8):
            for b in range(8):
                same_seed = results[a][key][0] == results[b][key][0]
                same_draws = results[a][key][1] == results[b][key][1]
                assert same_seed == same_draws, (key, a, b)
    # Replicas (ranks r and r+4 differ only in the DDP dim) draw the same numbers.
    assert all(results[r]["pp_tp"][1] == results[r + 4]["pp_tp"][1] for r in range(4))


def _four_dim_seeds(rank: int, world_size: int) -> tuple[int, int, list[float]]:
    # PP 2 x HSDP (2 replicas x 2 shards) x TP 2 through ParallelDims, default sharded dims.
    dims = ParallelDims(dp_replicate=2, dp_shard=2, cp=1, tp=2, pp=2, world_size=world_size)
    mesh = dims.build_mesh("cpu")
    seed = manual_seed(1000, mesh=mesh, sharded_dims=["pp", "dp_shard", "cp", "tp"])
    draws = torch.rand(3).tolist()
    reordered = manual_seed(1000, mesh=mesh, sharded_dims=["tp", "dp_replicate", "dp_shard", "pp"])
    return seed, reordered, draws


@pytest.mark.slow
def test_four_dim_mesh_default_order():
    results = run_ranks(_four_dim_seeds, 16, timeout=300)
    for rank, (seed, reordered, _) in enumerate(results):
        pp, rep, shard, tp = rank // 8, (rank // 4) % 2, (rank // 2) % 2, rank % 2
        assert seed == 1000 + pp * 4 + shard * 2 + tp  # cp is disabled: it adds nothing
        assert reordered == 1000 + ((tp * 2 + rep) * 2 + shard) * 2 + pp
    by_seed: dict[int, list] = {}
    for seed, _, draws in results:
        by_seed.setdefault(seed, []).append(draws)
    assert len(by_seed) == 8  # every shard position is distinct ...
    for replicas in by_seed.values():  # ... and each one has 2 identical replicas
        assert len(replicas) == 2 and replicas[0] == replicas[1]


def _seed_without_collectives(rank: int, world_size: int) -> int:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    group = mesh.get_group("tp")
    called = []
    saved = {name: getattr(dist, name) for name in COLLECTIVES}

    def forbidden(name):
        def fail(*args, **kwargs):
            called.append(name)
            raise RuntimeError(f"seeding issued a collective: {name}")

        return fail

    for name in COLLECTIVES:
        setattr(dist, name, forbidden(name))
    try:
        seed = -1
        # Only some ranks seed: a collective inside would hang or fail on the others.
        if rank % 2 == 0:
            seed = manual_seed(7, mesh=mesh, sharded_dims=["dp_shard", "tp"])
            manual_seed(7, sharded_groups=[group])
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
    assert not called, called
    return seed


@pytest.mark.slow
def test_no_collective_is_issued():
    seeds = run_ranks(_seed_without_collectives, 4, collective_timeout=20)
    assert seeds == [7, -1, 9, -1]


def test_offset_is_row_major_first_most_significant():
    assert sharded_offset([1, 0, 1], [2, 3, 2]) == 1 * 6 + 0 * 2 + 1
    assert sharded_offset([], []) == 0


def test_argument_errors():
    with pytest.raises(ValueError, match="exactly one"):
        manual_seed(1)
    with pytest.raises(ValueError, match="needs the mesh"):
        manual_seed(1, sharded_dims=["tp"])
    with pytest.raises(TypeError, match="must be an int"):
        manual_seed("1", sharded_groups=[])  # type: ignore[arg-type]


def _unknown_dim(rank: int, world_size: int) -> str:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    try:
        manual_seed(1, mesh=mesh, sharded_dims=["tp", "zz"])
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.slow
def test_unknown_dim_rejected_on_every_rank():
    messages = run_ranks(_unknown_dim, 2)
    assert all("zz" in m for m in messages)
