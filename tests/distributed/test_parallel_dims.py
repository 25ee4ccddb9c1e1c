"""ParallelDims: the validation table, and real 8-rank meshes: the world, its views, the dense and sparse meshes."""

from __future__ import annotations

import itertools
import math
import warnings

import pytest
import torch.distributed as dist
from dist_harness import run_ranks

from torchtitan.compat import all_process_groups, group_timeouts
from torchtitan.distributed import FLATTENED_VIEWS, ParallelDims, manual_seed
from torchtitan.distributed.lifecycle import set_collective_timeout
from torchtitan.distributed.parallel_dims import ROOT_MESHES, same_layout

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
    "degrees, world, needles",
    [
        ((0, -1, 1, 1, 1), 8, ["--parallelism.data_parallel_replicate_degree=0: use a degree >= 1"]),
        ((1, 0, 1, 1, 1), 8, ["--parallelism.data_parallel_shard_degree=0: use -1"]),
        ((1, -2, 1, 1, 1), 8, ["--parallelism.data_parallel_shard_degree=-2: use -1"]),
        ((1, -1, -1, 1, 1), 8, ["--parallelism.context_parallel_degree=-1: use a degree >= 1"]),
        ((1, -1, 1, 0, 1), 8, ["--parallelism.tensor_parallel_degree=0: use a degree >= 1"]),
        ((1, -1, 1, 1, -1), 8, ["--parallelism.pipeline_parallel_degree=-1: use a degree >= 1"]),
        ((1, -1, 1, 3, 1), 8, ["--parallelism.tensor_parallel_degree=3 does not divide", "(world_size=8)",
                               "set --parallelism.tensor_parallel_degree to 1 or 2 or 4 or 8",
                               "or launch a multiple of 3 processes"]),
        ((1, -1, 1, 3, 1), 2, ["--parallelism.tensor_parallel_degree=3 does not divide", "(world_size=2)",
                               "set --parallelism.tensor_parallel_degree to 1 or 2,"]),
        ((2, -1, 3, 1, 1), 8, ["--parallelism.data_parallel_replicate_degree=2 x "
                               "--parallelism.context_parallel_degree=3 = 6 does not divide",
                               "change them so their product divides it",
                               "or launch a multiple of 6 processes"]),
        ((2, 2, 1, 1, 1), 8, ["--parallelism.data_parallel_replicate_degree=2 x "
                              "--parallelism.data_parallel_shard_degree=2 = 4, but world_size=8",
                              "--parallelism.data_parallel_shard_degree=-1"]),
        ((1, 1, 1, 1, 1), 2, ["--parallelism.data_parallel_shard_degree=1 = 1, but world_size=2"]),
        ((1, 4, 1, 2, 2), 8, ["= 16, but world_size=8"]),
        ((1, 1, 1, 1, 1), 0, ["world_size=0 must be >= 1"]),
    ],
)
def test_invalid_degrees_name_the_option_and_the_fix(degrees, world, needles):
    dp_replicate, dp_shard, cp, tp, pp = degrees
    with pytest.raises(ValueError) as info:
        ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, pp=pp, world_size=world)
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message


def test_expert_degree_must_divide_dp_shard_times_cp_times_tp():
    within = ParallelDims(dp_replicate=1, dp_shard=2, cp=2, tp=2, pp=1, world_size=8, ep=4)
    assert within.degree("efsdp") == 1 and within.degree("etp") == 2 and not within.ep_borrows_tp
    with pytest.raises(ValueError, match=r"^--parallelism.expert_parallel_degree=3 must divide dp_shard x cp x tp = "
                                         r"4 x 1 x 2 = 8: .* pick a degree that divides 8"):
        ParallelDims(dp_replicate=1, dp_shard=4, cp=1, tp=2, pp=1, world_size=8, ep=3)
    with pytest.raises(ValueError, match=r"^--parallelism.expert_parallel_degree=4 must divide dp_shard x cp x tp = "
                                         r"2 x 1 x 1 = 2"):
        ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, world_size=2, ep=4)


@pytest.mark.parametrize("degrees, efsdp", [
    (dict(dp_shard=2, tp=2, ep=4, world_size=4), 1),  # EP 4 on TP 2 x FSDP 2
    (dict(dp_shard=2, tp=4, ep=4, world_size=8), 2),
    (dict(dp_shard=16, tp=2, pp=8, ep=32, world_size=256), 1),  # Qwen3-235B-A22B's published layout
    (dict(dp_shard=3, cp=2, tp=2, ep=4, world_size=12), 3),
])
def test_expert_parallelism_borrows_all_of_tp_when_dp_shard_x_cp_cannot_hold_it(degrees, efsdp):
    dims = ParallelDims(**{"dp_replicate": 1, "cp": 1, "pp": 1, **degrees})
    assert dims.ep_borrows_tp and dims.degree("etp") == 1 and dims.degree("efsdp") == efsdp
    assert dims.degree("efsdp") * dims.ep == dims.dp_shard * dims.cp * dims.tp


def test_expert_parallelism_that_needs_tp_must_cover_all_of_it():
    """ep 2 on dp_shard 1 x tp 4 would take half of TP's ranks: refused, naming the degrees that work."""
    with pytest.raises(ValueError) as info:
        ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=4, pp=1, world_size=4, ep=2)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("--parallelism.expert_parallel_degree=2 needs the ranks of "
                              "--parallelism.tensor_parallel_degree=4"), message
    assert "does not cover all of them; use a degree that divides 1 or a multiple of 4 that divides 4" in message


def test_axes_layout_and_rank_at():
    dims = ParallelDims(dp_replicate=2, dp_shard=-1, cp=1, tp=2, pp=2, world_size=16)
    assert dims.axes() == [("pp", 2), ("dp_replicate", 2), ("dp_shard", 2), ("cp", 1), ("tp", 2), ("ep", 1)]
    assert dims.layout() == {"world_size": 16, **dict(dims.axes())}
    assert [dims.rank_at(pp=r) for r in range(2)] == [0, 8]
    assert dims.rank_at(dp_replicate=1, dp_shard=1, tp=1) == 7
    with pytest.raises(ValueError, match="unknown axis ep"):
        dims.rank_at(ep=1)
    # A record written before an axis existed holds that axis at degree 1.
    old = {k: v for k, v in dims.layout().items() if k != "ep"}
    assert same_layout(old, dims.layout()) and not same_layout({**old, "tp": 1}, dims.layout())
    assert not same_layout(None, dims.layout())
    assert dims.degree("batch") == 4 and dims.degree("loss") == 4 and dims.degree("fsdp") == 2


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
    for name, (pp, rep, shard, cp, tp, *ep) in layouts.items():
        dims = ParallelDims(dp_replicate=rep, dp_shard=shard, cp=cp, tp=tp, pp=pp, world_size=world_size,
                            ep=ep[0] if ep else 1)
        mesh = dims.build_mesh("cpu")
        views = {}
        for view in (*ORDER, *FLATTENED_VIEWS, "fsdp", "batch", "loss", "ep", "efsdp"):
            sub = dims.get_mesh(view)
            views[view] = None if sub is None else (sub.get_local_rank(), sub.size(),
                                                    dist.get_process_group_ranks(sub.get_group()))
        fsdp = dims.fsdp_mesh()
        out[name] = {
            "names": mesh.mesh_dim_names,
            "shape": tuple(mesh.shape),
            "coordinate": mesh.get_coordinate(),
            "roots": {root: (dims.root_mesh(root).mesh_dim_names, tuple(dims.root_mesh(root).shape),
                             dims.root_mesh(root)._get_root_mesh() is mesh._get_root_mesh()) for root in ROOT_MESHES},
            "views": views,
            "fsdp": None if fsdp is None else (fsdp.mesh_dim_names, tuple(fsdp.shape)),
            "one_rank_fsdp": tuple(dims.one_rank_fsdp_mesh().shape),
            "labels": sorted(set(dims.group_labels().values())),
            "routing": _ranks(dims.routing_mesh()),
            "seed": manual_seed(100, dims=dims, sharded_dims=["pp", "dp_shard", "cp", "tp", "ep"]),
        }
    out["timeouts"] = _training_timeouts()
    return out


TRAIN_TIMEOUT_S = 77


def _training_timeouts() -> list[tuple[str, float | None]]:
    """The trainer's training timeout set on every group the layouts made, then each backend's timeout as it
    applies it, over every group of several ranks: ``("gloo", TRAIN_TIMEOUT_S)``, and ``("fake", None)`` for the
    placement-only dims (a fake group waits for nobody: it has no timeout)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch only warns where it sets no timeout
        set_collective_timeout(TRAIN_TIMEOUT_S)
    applied = {(backend, None if timeout is None else timeout.total_seconds())
               for group in all_process_groups() if group.size() > 1
               for backend, timeout in group_timeouts(group).items()}
    return sorted(applied, key=str)


def _ranks(mesh) -> list[int] | None:  # noqa: ANN001 - a DeviceMesh or None
    return None if mesh is None else dist.get_process_group_ranks(mesh.get_group())


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
        for rank, per_rank in enumerate(results):
            got = per_rank[name]
            # Every axis is kept, at degree 1 too: the rank's coordinate is its row-major index.
            assert got["names"] == ORDER, name
            assert got["shape"] == degrees, name
            assert list(got["coordinate"]) == _unravel(rank, list(degrees)), name
            for view in ORDER:
                assert got["views"][view] == _expected_view(rank, sizes, (view,)), (name, view, rank)
            for view, dims in FLATTENED_VIEWS.items():
                assert got["views"][view] == _expected_view(rank, sizes, dims), (name, view, rank)
            assert got["views"]["fsdp"] == got["views"]["dp_shard_cp"], name  # FSDP's axis is dp_shard x cp
            assert got["views"]["batch"] == got["views"]["dp"] and got["views"]["loss"] == got["views"]["dp_cp"]
            assert got["views"]["ep"] is None and got["views"]["efsdp"] is None, name  # ep = 1: no sparse groups
            fsdp = sizes["dp_shard"] * sizes["cp"]
            assert got["roots"] == {
                "world": (ORDER, degrees, True),
                "dense": (("pp", "dp_replicate", "fsdp", "tp"), (sizes["pp"], sizes["dp_replicate"], fsdp, sizes["tp"]),
                          True),
                "sparse": (("pp", "dp_replicate", "efsdp", "ep", "etp"),
                           (sizes["pp"], sizes["dp_replicate"], fsdp, 1, sizes["tp"]), True),
            }, name
            assert got["one_rank_fsdp"] == (fsdp,)
            # The default seeding order; degree-1 axes add nothing (the seeding tests pin the rest).
            c = dict(zip(ORDER, _unravel(rank, list(degrees))))
            assert got["seed"] == 100 + _ravel([c["pp"], c["dp_shard"], c["cp"], c["tp"]],
                                               [sizes["pp"], sizes["dp_shard"], sizes["cp"], sizes["tp"]])
    # FSDP's mesh: the dense mesh's fsdp axis, with dp_replicate for HSDP and DDP (fsdp of size 1).
    assert results[0]["fsdp8"]["fsdp"] == (("fsdp",), (8,))
    assert results[0]["hsdp2x4"]["fsdp"] == (("dp_replicate", "fsdp"), (2, 4))
    assert results[0]["ddp8"]["fsdp"] == (("dp_replicate", "fsdp"), (8, 1))
    assert results[0]["cp2_tp2_fsdp2"]["fsdp"] == (("fsdp",), (4,))
    assert results[0]["pp2_hsdp2x2"]["fsdp"] == (("dp_replicate", "fsdp"), (2, 2))
    assert results[0]["pp2_tp2_cp2"]["fsdp"] == (("fsdp",), (2,))
    assert results[0]["tp2_fsdp4"]["views"]["dp"][1] == 4  # dp resolves under FSDP-only
    assert results[0]["ddp8"]["views"]["dp"][1] == 8  # ... and under DDP-only
    # The planner's labels: a group over one enabled axis goes by that axis (FSDP over dp_shard is dp_shard).
    assert results[0]["tp2_fsdp4"]["labels"] == ["dp_shard", "tp"]
    assert results[0]["cp2_tp2_fsdp2"]["labels"] == ["cp", "dp_cp", "dp_shard", "dp_shard_cp", "tp"]
    assert results[0]["pp2_tp2_cp2"]["labels"] == ["cp", "pp", "tp"]
    # Every group the layouts made (dims, views, both roots) applies the training timeout, or is fake.
    assert all(r["timeouts"] == [("fake", None), ("gloo", TRAIN_TIMEOUT_S)] for r in results), results[0]["timeouts"]


@pytest.mark.slow
def test_world_size_one():
    (result,) = run_ranks(_describe_meshes, 1, {"single": (1, 1, 1, 1, 1)})
    got = result["single"]
    assert got["names"] == ORDER and got["shape"] == (1, 1, 1, 1, 1)
    assert all(v is None for v in got["views"].values())  # no axis of degree > 1: no group to run over
    assert got["fsdp"] is None and got["one_rank_fsdp"] == (1,)
    assert got["labels"] == [] and got["seed"] == 100


# (pp, dp_replicate, dp_shard, cp, tp, ep): experts borrow ep ranks from dp_shard x cp, and all of tp where
# dp_shard x cp cannot hold ep (the last three).
EP_LAYOUTS = {"ep2_fsdp8": (1, 1, 8, 1, 1, 2), "ep2_cp2_tp2": (1, 1, 2, 2, 2, 2), "hsdp2x2_ep2": (1, 2, 2, 1, 2, 2),
              "hsdp2x2_tp2_ep4": (1, 2, 2, 1, 2, 4), "fsdp2_tp4_ep4": (1, 1, 2, 1, 4, 4),
              "pp2_fsdp2_tp2_ep4": (2, 1, 2, 1, 2, 4)}


@pytest.mark.slow  # spawns gloo ranks
def test_sparse_mesh_at_ep_two():
    results = run_ranks(_describe_meshes, 8, EP_LAYOUTS)
    for name, (pp, rep, shard, cp, tp, ep) in EP_LAYOUTS.items():
        borrows = (shard * cp) % ep != 0
        etp = 1 if borrows else tp  # the TP ranks that run a MoE layer on the same tokens
        efsdp = shard * cp * tp // (ep * etp)
        for rank, per_rank in enumerate(results):
            got = per_rank[name]
            assert got["roots"]["sparse"] == (("pp", "dp_replicate", "efsdp", "ep", "etp"), (pp, rep, efsdp, ep, etp),
                                              True), name
            assert got["roots"]["world"][1] == (pp, rep, shard, cp, tp)  # the world mesh is unchanged by ep
            c = dict(zip(ORDER, _unravel(rank, [pp, rep, shard, cp, tp])))
            inner = c["dp_shard"] * cp + c["cp"]  # this rank's index in dp_shard x cp
            stage_replica = rank - inner * tp - c["tp"]  # the first rank of its (pp, dp_replicate) coordinate
            if borrows:
                # ep takes all of tp and the inner ep / tp ranks of dp_shard x cp: neighbours in rank order.
                inner = inner * tp + c["tp"]
                ep_group = [stage_replica + (inner // ep) * ep + i for i in range(ep)]
                routing = list(range(stage_replica - c["dp_replicate"] * shard * cp * tp,
                                     stage_replica + (rep - c["dp_replicate"]) * shard * cp * tp))
            else:
                # ep takes the inner ranks of dp_shard x cp: neighbours in that flattened order.
                ep_group = [stage_replica + c["tp"] + ((inner // ep) * ep + i) * tp for i in range(ep)]
                routing = got["views"]["dp_cp"][2]  # TP ranks route the same tokens: counted over dp x cp
            assert got["views"]["ep"] == (inner % ep, ep, ep_group), (name, rank)
            assert got["routing"] == routing, (name, rank)
            if efsdp > 1:
                assert got["views"]["efsdp"][:2] == (inner // ep, efsdp), (name, rank)
            else:
                assert got["views"]["efsdp"] is None
            assert "ep" in got["labels"]
    assert results[0]["ep2_fsdp8"]["views"]["efsdp"] == (0, 4, [0, 2, 4, 6])
    assert results[5]["hsdp2x2_tp2_ep4"]["views"]["ep"] == (1, 4, [4, 5, 6, 7])
    assert results[2]["fsdp2_tp4_ep4"]["views"]["efsdp"] == (0, 2, [2, 6])
    assert results[3]["pp2_fsdp2_tp2_ep4"]["routing"] == [0, 1, 2, 3]
    # The expert groups apply the training timeout too.
    assert all(r["timeouts"] == [("fake", None), ("gloo", TRAIN_TIMEOUT_S)] for r in results), results[0]["timeouts"]
    # manual_seed over ParallelDims reaches ep: ranks 0 and 1 of ep2_fsdp8 differ in dp_shard and ep.
    assert [r["ep2_fsdp8"]["seed"] for r in results[:2]] == [100, 100 + 1 * 2 + 1]


@pytest.mark.parametrize("degrees", [dict(dp_replicate=2, dp_shard=1, cp=1, tp=1, pp=1, world_size=2),
                                     dict(dp_replicate=1, dp_shard=1, cp=2, tp=2, pp=1, world_size=4),
                                     dict(dp_replicate=1, dp_shard=4, cp=2, tp=1, pp=2, world_size=16, ep=8),
                                     dict(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, world_size=1)])
def test_every_enabled_flag_is_degree_above_one_from_the_axis_table(degrees):
    from torchtitan.distributed.parallel_dims import AXES, AXIS_TABLE, WORLD_AXES

    dims = ParallelDims(**degrees)
    assert WORLD_AXES == ("pp", "dp_replicate", "dp_shard", "cp", "tp") and AXES == (*WORLD_AXES, "ep")
    for axis in AXIS_TABLE:
        assert dims.enabled(axis.name) == (dims.degree(axis.name) > 1)
    assert dims.fsdp_enabled == (dims.dp_shard * dims.cp > 1)
    assert dims.dp_enabled == (dims.dp_replicate > 1 or dims.dp_shard > 1)
    for name in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep"):
        assert getattr(dims, f"{name}_enabled") == (degrees.get(name, 1) > 1), name


def test_loss_parallel_comes_from_the_config_at_construction():
    from torchtitan.config import ConfigManager

    for flag, want in (([], True), (["--parallelism.disable_loss_parallel"], False)):
        cfg = ConfigManager().parse_args(["--parallelism.tensor_parallel_degree=2", *flag])
        dims = ParallelDims.from_config(cfg.parallelism, 2)
        assert dims.loss_parallel is want and dims.loss_parallel_enabled is want
    assert not ParallelDims(1, 2, 1, 1, 1, 2).loss_parallel_enabled  # no TP: nothing to parallelize
