"""Muon on one process: the update against a reference written here, which parameters it takes, its
state's checkpoint round trip, and the refusals (docs/optimizers.md)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from torchtitan.config import ConfigError
from torchtitan.optim import build_optimizer
from torchtitan.optim.muon import Muon, MuonSettings, newton_schulz
from torchtitan.optim.muon_owners import _is_grid, _tiled_whole, assign_owners, newton_schulz_cost
from torchtitan.optim.muon_params import split_params

FP32 = MuonSettings(ns_dtype="float32")


def _reference_ns(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The published quintic iteration, for one 2-D matrix, in float32."""
    x = g.T if g.shape[0] > g.shape[1] else g
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        a = x @ x.T
        x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
    return x.T if g.shape[0] > g.shape[1] else x


@pytest.mark.parametrize("shape", [(8, 24), (24, 8)])
def test_newton_schulz_brings_singular_values_near_one(shape):
    torch.manual_seed(0)
    g = torch.randn(shape)
    o = newton_schulz(g, 5, torch.float32)
    assert o.shape == g.shape
    singular = torch.linalg.svdvals(o)
    assert singular.min() > 0.6 and singular.max() < 1.25, singular
    torch.testing.assert_close(o, _reference_ns(g))


def _two_steps(settings: MuonSettings, weight_decay: float = 0.1) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(1)
    w = nn.Parameter(torch.randn(6, 10))
    grads = [torch.randn(6, 10), torch.randn(6, 10)]
    opt = Muon([w], [], lr=0.05, weight_decay=weight_decay, betas=(0.9, 0.95), eps=1e-8, settings=settings)
    start = w.detach().clone()
    for g in grads:
        w.grad = g
        opt.step()
    return start, [w.detach().clone(), *grads]


def test_update_is_nesterov_momentum_orthogonalized_scaled_with_decoupled_decay():
    start, (final, g1, g2) = _two_steps(FP32)
    lr, wd, mu, scale = 0.05, 0.1, 0.95, 0.2 * math.sqrt(10)
    w, buf = start.clone(), torch.zeros_like(start)
    for g in (g1, g2):
        buf = mu * buf + g
        w = w * (1 - lr * wd) - lr * scale * _reference_ns(g + mu * buf)
    torch.testing.assert_close(final, w)


def test_plain_momentum_and_shape_ratio_scale():
    start, (final, g1, g2) = _two_steps(MuonSettings(nesterov=False, ns_dtype="float32",
                                                     update_scale="shape_ratio"), weight_decay=0.0)
    buf = g1
    w = start - 0.05 * _reference_ns(buf)  # 6 x 10: sqrt(max(1, 6/10)) = 1
    buf = 0.95 * buf + g2
    w = w - 0.05 * _reference_ns(buf)
    torch.testing.assert_close(final, w)


def test_bfloat16_iteration_is_close_to_float32():
    start, (final32, *_) = _two_steps(FP32)
    _, (final16, *_) = _two_steps(MuonSettings())
    assert not torch.equal(final32, final16)  # the dtype option is applied
    torch.testing.assert_close(final16 - start, final32 - start, atol=5e-3, rtol=0.05)


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(16, 8)
        self.proj = nn.Linear(8, 12, bias=True)
        self.norm = nn.RMSNorm(12)
        self.router = nn.Module()
        self.router.gate = nn.Linear(12, 3, bias=False)
        self.experts = nn.Parameter(torch.randn(3, 5, 12))
        self.experts_bias = nn.Parameter(torch.randn(3, 5))
        self.output = nn.Linear(12, 16, bias=False)


def test_split_keeps_tables_vectors_and_routers_for_adamw():
    groups = split_params([_Tiny()])
    assert sorted(groups.names[p] for p in groups.matrices) == ["experts", "proj.weight"]
    assert sorted(groups.names[p] for p in groups.others) == [
        "experts_bias", "norm.weight", "output.weight", "proj.bias", "router.gate.weight", "tok_embeddings.weight"]


# per flavor: the head-split weights of layer 0's attention and their parts (--optimizer.muon_split_heads)
HEAD_PARTS = {
    "llama3": {"wq": (16,) * 16, "wk": (16,) * 8, "wv": (16,) * 8},  # n_heads 16, n_kv_heads 8, head_dim 16
    "gpt_oss": {"wq": (32,) * 8, "wk": (32,) * 4, "wv": (32,) * 4},  # sink attention is grouped-query attention
    # MLA: q_lora_rank 96 (wq_b), per head qk_nope 32 + qk_rope 16 query rows; wkv_b: 32 key, then 24 value rows
    "deepseek_v3": {"wq_b": (48,) * 8, "wkv_b": (32, 24) * 8},
}


@pytest.mark.parametrize("flavor", [("llama3", "debugmodel_tied"), ("deepseek_v3", "debugmodel"),
                                    ("gpt_oss", "debugmodel")])
def test_split_of_the_debug_models(flavor):
    from torchtitan.models.registry import get_model_spec, model_args

    with torch.device("meta"):
        model = get_model_spec(flavor[0]).build(model_args(*flavor))
    groups = split_params([model])
    names = {groups.names[p]: p for p in groups.matrices}
    assert not any("embeddings" in n or n.startswith("output") or "router" in n or "norm" in n for n in names)
    assert "layers.0.attention.wo.weight" in names
    fused = {p: (64, 16) for n, p in names.items() if n.endswith("attention.wkv_a.weight")}
    if flavor[0] == "llama3":  # tied: the one table is the embedding's, AdamW's
        assert [groups.names[p] for p in groups.others if p.ndim == 2] == ["tok_embeddings.weight"]
    if flavor[0] == "deepseek_v3":
        assert "layers.1.feed_forward.experts.w1" in names
        assert len(fused) == 4  # kv_lora_rank, rope
    assert groups.row_parts == fused  # --optimizer.muon_split_heads off: the fused weights only, as before it
    # on, through the optimizer's build: every layer's query/key/value weights in their heads' rows
    muon = build_optimizer([], name="Muon", lr=0.01, eps=1e-8, weight_decay=0.1, betas=(0.9, 0.95), device_type="cpu",
                           model_parts=[model], muon=MuonSettings(split_heads=True))
    assert isinstance(muon, Muon)
    expected = {names[f"layers.{i}.attention.{w}.weight"]: parts for w, parts in HEAD_PARTS[flavor[0]].items()
                for i in range(model.args.n_layers)}
    assert muon.row_parts == {**fused, **expected}


def _heads_reference(g: torch.Tensor, parts: tuple[int, ...]) -> torch.Tensor:
    """Each part's rows orthogonalized and scaled on their own, one after the other."""
    return torch.cat([0.2 * math.sqrt(max(part.shape)) * _reference_ns(part) for part in g.split(list(parts))])


def test_split_heads_orthogonalizes_each_heads_rows_alone():
    torch.manual_seed(5)
    gqa = nn.Parameter(torch.randn(12, 16))  # 3 heads of 4 rows
    mla = nn.Parameter(torch.randn(15, 16))  # 3 heads of 3 key rows then 2 value rows
    whole = nn.Parameter(torch.randn(12, 16))  # the option off: one matrix, as without it
    parts = {gqa: (4,) * 3, mla: (3, 2) * 3}
    opt = Muon([gqa, mla, whole], [], lr=0.1, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8, settings=FP32,
               row_parts=parts)
    start = {p: p.detach().clone() for p in (gqa, mla, whole)}
    for p in start:
        p.grad = torch.randn(p.shape)
    opt.step()
    for p, heads in parts.items():  # Nesterov's first update is (1 + mu) * grad
        expected = start[p] - 0.1 * _heads_reference(1.95 * p.grad, heads)
        torch.testing.assert_close(p.detach(), expected)
    # the whole matrix, bitwise: the same operations as the optimizer's, with the one-matrix iteration
    nesterov = whole.grad.add(torch.zeros(12, 16).mul_(0.95).add_(whole.grad), alpha=0.95)
    today = newton_schulz(nesterov, 5, torch.float32) * (0.2 * math.sqrt(16))
    assert torch.equal(whole.detach(), start[whole].mul_(1.0).add_(today, alpha=-0.1))


def test_experts_are_batched_matrices_and_fused_rows_are_orthogonalized_per_part():
    torch.manual_seed(2)
    experts = nn.Parameter(torch.randn(3, 5, 12))
    fused = nn.Parameter(torch.randn(10, 12))
    opt = Muon([experts, fused], [], lr=0.1, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8, settings=FP32,
               row_parts={fused: (6, 4)})
    e0, f0 = experts.detach().clone(), fused.detach().clone()
    experts.grad, fused.grad = torch.randn(3, 5, 12), torch.randn(10, 12)
    opt.step()
    for e in range(3):  # each expert as its own matrix: Nesterov's first update is (1 + mu) * grad
        expected = e0[e] - 0.1 * 0.2 * math.sqrt(12) * _reference_ns(1.95 * experts.grad[e])
        torch.testing.assert_close(experts.detach()[e], expected)
    top, bottom = (1.95 * fused.grad).split([6, 4])
    expected = f0 - 0.1 * 0.2 * math.sqrt(12) * torch.cat([_reference_ns(top), _reference_ns(bottom)])
    torch.testing.assert_close(fused.detach(), expected)


def test_adamw_fqns_send_the_matching_parameters_to_adamw():
    groups = split_params([_Tiny()], adamw_fqns=("proj",))
    assert [groups.names[p] for p in groups.matrices] == ["experts"]
    assert {"proj.weight", "proj.bias"} <= {groups.names[p] for p in groups.others}


def test_muon_parameter_options_that_cannot_apply_are_refused_in_one_line(debug_cfg):
    import dataclasses

    from torchtitan.models.registry import get_model_spec, model_args
    from torchtitan.optim.muon_checks import muon_model_problems

    def problems(*options: str, patterns: list[str] | None = None) -> list[str]:
        o = debug_cfg(*options).optimizer
        o = o if patterns is None else dataclasses.replace(o, muon_adamw_fqns=patterns)
        return muon_model_problems(o, lambda: get_model_spec("llama3").build(model_args("llama3", "debugmodel")),
                                   "llama3 debugmodel")

    muon = ("--optimizer.name=Muon", "--optimizer.muon_split_heads")
    assert problems(*muon, "--optimizer.muon_adamw_fqns=attention.wq,feed_forward") == []
    assert problems(*muon, "--optimizer.muon_adamw_fqns=attention.wq,nosuch") == [
        "--optimizer.muon_adamw_fqns: no parameter of llama3 debugmodel has 'nosuch' in its name, so it sends nothing "
        "to AdamW; name part of a parameter's FQN such as layers.0.attention.wq.weight, or drop it"]
    assert problems(*muon, patterns=["wq", ""]) == [
        "--optimizer.muon_adamw_fqns: an empty pattern is part of every parameter's name and would send them all to "
        "AdamW; drop it"]
    unused = problems("--optimizer.muon_split_heads", "--optimizer.muon_adamw_fqns=wq")  # the optimizer is AdamW
    assert [line.split(":")[0] for line in unused] == ["--optimizer.muon_split_heads", "--optimizer.muon_adamw_fqns"]
    settings = MuonSettings.from_config(debug_cfg(*muon, "--optimizer.muon_adamw_fqns=wq,wk").optimizer)
    assert settings.split_heads and settings.adamw_fqns == ("wq", "wk")


def test_an_adamw_fqn_that_matches_nothing_stops_the_launch_before_any_process_group(debug_cfg):
    from torchtitan.preflight import preflight

    with pytest.raises(ConfigError) as info:  # the launcher's preflight: exit 2 before any rank starts
        preflight(debug_cfg("--optimizer.name=Muon", "--optimizer.muon_adamw_fqns=nosuch"), 2)
    assert [line.split(":")[0] for line in info.value.problems] == ["--optimizer.muon_adamw_fqns"]


def test_adamw_part_matches_torch_adamw():
    torch.manual_seed(3)
    model = _Tiny()
    twin = _Tiny()
    twin.load_state_dict(model.state_dict())
    opt = build_optimizer(model.parameters(), name="Muon", lr=0.01, eps=1e-8, weight_decay=0.1, betas=(0.9, 0.95),
                          device_type="cpu", model_parts=[model], muon=FP32)
    groups = split_params([twin])
    reference = torch.optim.AdamW(groups.others, lr=0.01, eps=1e-8, weight_decay=0.1, betas=(0.9, 0.95))
    for _ in range(2):
        for m in (model, twin):
            for p in m.parameters():
                p.grad = torch.ones_like(p) * 0.1 + p.detach() * 0.01
        opt.step()
        reference.step()
    twins = dict(twin.named_parameters())
    for name, p in model.named_parameters():
        if any(twins[name] is other for other in groups.others):
            torch.testing.assert_close(p, twins[name], msg=name)


def test_state_dict_is_torch_standard_and_resumes_bitwise():
    torch.manual_seed(4)

    def build(model: nn.Module) -> torch.optim.Optimizer:
        return build_optimizer(model.parameters(), name="Muon", lr=0.01, eps=1e-8, weight_decay=0.1,
                               betas=(0.9, 0.95), device_type="cpu", model_parts=[model], muon=FP32)

    def step(model: nn.Module, opt: torch.optim.Optimizer, k: int) -> None:
        for p in model.parameters():
            p.grad = torch.sin(p.detach() * (k + 1))
        opt.step()

    straight = _Tiny()
    resumed = _Tiny()
    resumed.load_state_dict(straight.state_dict())
    opt = build(straight)
    for k in range(2):
        step(straight, opt, k)
    saved_model = {k: v.clone() for k, v in straight.state_dict().items()}
    saved = copy.deepcopy(opt.state_dict())  # the live state moves on with the next steps
    assert {k for s in saved["state"].values() for k in s} == {"momentum_buffer", "step", "exp_avg", "exp_avg_sq"}
    for k in range(2, 4):
        step(straight, opt, k)
    resumed.load_state_dict(saved_model)
    opt2 = build(resumed)
    opt2.load_state_dict(saved)
    for k in range(2, 4):
        step(resumed, opt2, k)
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


def test_blocks_tile_their_box_checked_in_linear_time_on_a_grid():
    """An owner checks that the blocks of the ranks it gathers tile one box. A grid (what Shard placements cut) is
    recognized without comparing every pair (1,024 FSDP blocks of a matrix, a 2 x 512 cut, empty blocks of an
    uneven cut left out); a tiling that is not a grid still passes through the pairwise check; an overlap, a hole or
    a block given twice is refused."""
    rows = [((8, 64), (8 * i, 0)) for i in range(1024)] + [((0, 64), (8192, 0))]
    assert _tiled_whole(rows) == ((0, 0), (8192, 64))
    cells = [((4, 8), (4 * i, 8 * j)) for i in range(2) for j in range(512)]
    assert _is_grid(cells, (0, 0), (8, 4096)) and _tiled_whole(cells) == ((0, 0), (8, 4096))
    l_shape = [((2, 2), (0, 0)), ((1, 1), (0, 2)), ((1, 1), (1, 2))]  # tiles 2 x 3, but not as a grid
    assert not _is_grid(l_shape, (0, 0), (2, 3)) and _tiled_whole(l_shape) == ((0, 0), (2, 3))
    hole = cells[:-1]
    assert not _is_grid(hole, (0, 0), (8, 4096)) and _tiled_whole(hole) == (None, ())
    twice = cells + cells[:1]
    assert not _is_grid(twice, (0, 0), (8, 4096)) and _tiled_whole(twice) == (None, ())
    overlap = [((2, 2), (0, 0)), ((2, 2), (0, 1))]
    assert _tiled_whole(overlap) == (None, ())


def test_owner_heap_balances_by_cost_and_is_deterministic():
    costs = [newton_schulz_cost(torch.Size(s), ()) for s in [(64, 64), (8, 8), (64, 64), (32, 64), (4, 32, 64)]]
    assert newton_schulz_cost(torch.Size((4, 32, 64)), ()) == 4 * 32 * 64 * 32
    assert newton_schulz_cost(torch.Size((80, 256)), (64, 16)) == 64 * 256 * 64 + 16 * 256 * 16
    owners = assign_owners(costs, [[0, 1, 2, 3]] * len(costs))
    assert owners == assign_owners(costs, [[0, 1, 2, 3]] * len(costs))
    load = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(4)]
    assert owners[0] != owners[2]  # the two largest apart
    assert max(load) == max(costs)  # no rank carries more than the largest item


def _owner_of_tp_weight(rank: int) -> int:
    """As ``rank`` of a fake (dp_shard 2, tp 2) world: the global owner rank of a TP x FSDP weight planned after a
    costlier one that FSDP alone shards over ``rank``'s dp_shard slice (ranks 0, 2 or 1, 3)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from torchtitan import compat
    from torchtitan.optim.muon_owners import OwnerUpdate

    dist.init_process_group("fake", store=compat.fake_process_group_store(), rank=rank, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        sliced = DTensor.from_local(torch.zeros(8, 16), mesh["dp_shard"], [Shard(0)], run_check=False)
        tp = DTensor.from_local(torch.zeros(2, 8), mesh, [Shard(0), Shard(0)], run_check=False)
        plan = OwnerUpdate([sliced, tp], {}, {}).plans[tp]
        return int(mesh.mesh[plan.owner].item())
    finally:
        dist.destroy_process_group()


def test_ranks_of_different_slices_agree_on_an_owner():
    # Each tp slice's FSDP mesh holds other ranks; were owners counted on those ranks, the two slices would
    # load different ranks with the sliced weight and pick different owners for the shared one: a hang.
    assert _owner_of_tp_weight(0) == _owner_of_tp_weight(1)


@pytest.mark.parametrize("option", ["--optimizer.muon_ns_steps=0", "--optimizer.muon_ns_dtype=float16",
                                    "--optimizer.muon_update_scale=spectral", "--optimizer.muon_momentum=-0.1"])
def test_bad_muon_options_are_refused_in_one_line(option, debug_cfg):
    with pytest.raises(ConfigError) as info:
        debug_cfg("--optimizer.name=Muon", option)
    assert len(info.value.problems) == 1 and info.value.problems[0].startswith(option.split("=")[0] + ":")


def test_muon_refuses_non_positive_lr_and_ns_steps():
    w = nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match="optimizer.lr must be positive"):
        Muon([w], [], lr=0.0, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8, settings=FP32)
    with pytest.raises(ValueError, match="optimizer.muon_ns_steps"):
        Muon([w], [], lr=0.1, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8, settings=MuonSettings(ns_steps=0))


@pytest.mark.parametrize("option", ["--stability.skip_nonfinite_steps",
                                    "--optimizer.lr=0", "--optimizer.muon_momentum=1.0"])
def test_what_muon_cannot_do_yet_is_refused_before_any_process_group(option, debug_cfg):
    from torchtitan.preflight import check_config

    assert not [line for line in check_config(debug_cfg("--optimizer.name=Muon")) if "Muon" in line]
    problems = [line for line in check_config(debug_cfg("--optimizer.name=Muon", option)) if "Muon" in line]
    assert len(problems) == 1 and problems[0].startswith(option.split("=")[0]), problems


def test_muon_under_tensor_parallelism_is_accepted(debug_cfg):  # muon_owners.py gathers TP's blocks too
    from torchtitan.preflight import check_config

    cfg = debug_cfg("--optimizer.name=Muon", "--parallelism.tensor_parallel_degree=2")
    assert not [line for line in check_config(cfg) if "Muon" in line or "tensor_parallel" in line]
