"""Expert parallelism on real gloo ranks equals one process holding every expert.

One 4-rank world runs every case (EP 4 on the whole world, EP 2 on a 2 x 2 (dp, ep) mesh).
Each rank routes its own tokens; routing is uneven, and some experts (in one case all of
a rank's experts) get no token; one case runs under activation checkpointing. The parent
then runs one process with all tokens and all experts and compares: the initial expert
weights (bitwise: layout-invariant init), the output and input gradients of each rank's
tokens, the router gradient summed over the ranks, each rank's expert-slice gradients
(summed over the dp ranks that hold the same slice), the token counts and the bias after
one auxiliary-loss-free update.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from dist_harness import run_ranks

from torchtitan.distributed.layout_init import init_params_layout_invariant
from torchtitan.models.expert_balance import update_expert_bias
from torchtitan.models.moe import MoE, MoEArgs

pytestmark = pytest.mark.slow

SEED, WORLD, COEFF = 7, 4, 0.01
CASES: dict[str, dict[str, Any]] = {
    "ep4_softmax": dict(ep=4, bias={0: 0.3, 7: -1e9},
                        args=dict(norm_topk_prob=True)),
    "ep2_deepseek": dict(ep=2, bias={1: -1e9, 4: 0.2},
                         args=dict(score_func="sigmoid", num_groups=4, topk_groups=2, route_scale=2.5,
                                   num_shared_experts=1)),
    "ep4_idle_rank_unaligned": dict(ep=4, bias={6: -1e9, 7: -1e9},  # rank 3's experts get nothing
                                    args=dict(hidden_dim=10, top_k=3)),
    # Activation checkpointing: the recompute inside backward exchanges again and must not count again.
    "ep2_checkpointed": dict(ep=2, bias={3: -1e9}, args=dict(norm_topk_prob=True), checkpoint=True),
    # The two-hop dispatch (node_dispatch.py): EP 4 as 2 "nodes" of 2 ranks; group-limited routing whose groups
    # are the nodes' halves, a shared expert, and expert 5 (on node 1) without tokens.
    "ep4_two_hop_deepseek": dict(ep=4, gpus_per_node=2, bias={5: -1e9, 0: 0.2},
                                 args=dict(score_func="sigmoid", num_groups=4, topk_groups=2, route_scale=2.5,
                                           num_shared_experts=1, top_k=3)),
    # 4 nodes of one rank each (hop 2 within a rank), rank 3's experts idle, under activation checkpointing.
    "ep4_two_hop_one_per_node": dict(ep=4, gpus_per_node=1, bias={6: -1e9, 7: -1e9}, args=dict(top_k=3),
                                     checkpoint=True),
    # EP 2 on a 2 x 2 (dp, ep) mesh: the EP ranks {0, 1} and {2, 3}, each pair split over two "nodes" of one rank.
    "ep2_two_hop": dict(ep=2, gpus_per_node=1, bias={2: -1e9}, args=dict(norm_topk_prob=True)),
}


def _args(case: dict[str, Any]) -> MoEArgs:
    base = dict(dim=16, hidden_dim=12, num_experts=8, top_k=2, load_balance_bias=True)
    return MoEArgs(**(base | case["args"]))


def _build(case: dict[str, Any], ep_mesh=None, overlap: bool = True) -> MoE:
    """On meta, expert-parallel if a mesh is given, then materialised and initialised as the trainer does."""
    from torchtitan.models.moe.parallel import apply_expert_parallel, node_hop_groups

    gpus_per_node = case.get("gpus_per_node", 0)
    with torch.device("meta"):
        moe = MoE(dataclasses.replace(_args(case), overlap_all_to_all=overlap, dispatch_gpus_per_node=gpus_per_node))
    if ep_mesh is not None:
        hops = node_hop_groups(ep_mesh.get_group(), gpus_per_node) if gpus_per_node else None
        apply_expert_parallel(moe, ep_mesh, hops)
    moe.to_empty(device="cpu")
    moe.init_buffers()
    init_params_layout_invariant(moe, SEED)
    for expert, value in case["bias"].items():
        moe.router.expert_bias[expert] = value
    return moe


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens and the gradient its loss puts on the output (uneven token counts)."""
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(2, 3 + rank, 16, generator=gen)
    return x, torch.randn(x.shape, generator=gen)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def _run_case(rank: int, case: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    ep = case["ep"]
    mesh = init_device_mesh("cpu", (WORLD // ep, ep), mesh_dim_names=("dp", "ep"))
    moe = _build(case, mesh["ep"])
    initial = {n: _local(getattr(moe.experts, n)) for n in ("w1", "w2", "w3")}
    x, g = _batch(rank)
    x.requires_grad_(True)
    if case.get("checkpoint"):
        from torch.utils.checkpoint import checkpoint

        y = checkpoint(moe, x, use_reentrant=False)
    else:
        y = moe(x)
    (y * g).sum().backward()
    gate_grad = moe.router.gate.weight.grad.clone()
    dist.all_reduce(gate_grad)  # the router is replicated: its gradient is summed over the data ranks
    expert_grads = {}
    for name in ("w1", "w2", "w3"):
        # Each expert's gradient is the mean over the ep ranks whose tokens it took (parallel.py): times
        # ep, then summed over the ranks that hold the same experts, it is the whole batch's sum.
        grad = _local(getattr(moe.experts, name).grad) * ep
        dist.all_reduce(grad, group=mesh["dp"].get_group())
        expert_grads[name] = grad
    shared = {n: p.grad.clone() for n, p in moe.named_parameters() if n.startswith("shared_experts")}
    for grad in shared.values():
        dist.all_reduce(grad)
    counts = update_expert_bias([moe], COEFF, group=dist.group.WORLD)
    return dict(dispatcher=type(moe.dispatcher).__name__, ep_rank=mesh["ep"].get_local_rank(),
                initial=initial, y=y.detach(), x_grad=x.grad,
                gate_grad=gate_grad, expert_grads=expert_grads, shared_grads=shared, counts=counts[0],
                bias=moe.router.expert_bias.clone())


def _refusal(rank: int) -> str:
    """The error for 6 experts over EP 4, raised before any collective (no rank waits in one)."""
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan.models.moe.parallel import apply_expert_parallel

    with torch.device("meta"):
        moe = MoE(MoEArgs(dim=16, hidden_dim=12, num_experts=6, top_k=2))
    try:
        apply_expert_parallel(moe, init_device_mesh("cpu", (WORLD,)))
    except ValueError as e:
        return str(e)
    return "accepted"


def _two_hop_refusal(rank: int) -> str:
    """The error for nodes of 3 ranks under EP 4 (nodes of 3 and 1 ranks), raised before any group is made."""
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan.models.moe.parallel import node_hop_groups

    try:
        node_hop_groups(init_device_mesh("cpu", (WORLD,)).get_group(), 3)
    except ValueError as e:
        return str(e)
    return "accepted"


def _spy_on(fn_class: type, name: str, events: list[str]) -> None:
    """Record ``name forward`` / ``name backward`` in ``events`` when ``fn_class`` (an autograd Function) runs."""
    forward, backward = fn_class.forward, fn_class.backward

    def spied_forward(ctx, *args):
        out = forward(ctx, *args)
        events.append(f"{name} forward")
        return out

    def spied_backward(ctx, *grads):
        out = backward(ctx, *grads)
        events.append(f"{name} backward")
        return out

    fn_class.forward, fn_class.backward = staticmethod(spied_forward), staticmethod(spied_backward)


def _overlap_run(rank: int, overlap: bool, name: str = "ep2_deepseek") -> dict[str, Any]:
    """A shared-experts case (at EP 2 unless ``name`` says) with ``overlap_all_to_all`` on or off: the order in
    which the rows' exchanges and the shared experts ran, forward and backward, the output and every gradient."""
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan.models.moe import dispatch

    case = CASES[name]
    mesh = init_device_mesh("cpu", (WORLD // case["ep"], case["ep"]), mesh_dim_names=("dp", "ep"))
    moe = _build(case, mesh["ep"], overlap=overlap)
    events: list[str] = []
    spied = {dispatch._AllToAll: "exchange", dispatch._IssueAllToAll: "issue", dispatch._WaitAllToAll: "wait"}
    saved = {cls: (cls.forward, cls.backward) for cls in spied}
    for cls, name in spied.items():
        _spy_on(cls, name, events)
    shared = moe.shared_experts
    assert shared is not None
    shared.register_forward_pre_hook(lambda *_: events.append("shared forward"))

    def mark_backward(_module, _args, out: torch.Tensor) -> None:
        out.register_hook(lambda _grad: events.append("shared backward"))  # when its backward starts

    shared.register_forward_hook(mark_backward)
    shared.w1.weight.register_hook(lambda g: events.append("shared backward done"))
    try:
        x, g = _batch(rank)
        x.requires_grad_(True)
        y = moe(x)
        events.append("backward")
        (y * g).sum().backward()
    finally:
        for cls, (forward, backward) in saved.items():
            cls.forward, cls.backward = staticmethod(forward), staticmethod(backward)
    grads = {n: _local(p.grad) for n, p in moe.named_parameters()}
    return dict(events=events, y=y.detach(), x_grad=x.grad, grads=grads)


def _all_cases(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {name: _run_case(rank, case) for name, case in CASES.items()}
    out["refusal"] = _refusal(rank)
    out["two_hop_refusal"] = _two_hop_refusal(rank)
    out["overlap"] = {on: _overlap_run(rank, on) for on in (True, False)}
    out["two_hop_overlap"] = {on: _overlap_run(rank, on, "ep4_two_hop_deepseek") for on in (True, False)}
    return out


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return run_ranks(_all_cases, WORLD, timeout=300)


def _reference(case: dict[str, Any]) -> dict[str, Any]:
    moe = _build(case)
    batches = [_batch(r) for r in range(WORLD)]
    xs = [x.clone().requires_grad_(True) for x, _ in batches]
    ys = [moe(torch.cat([x.reshape(-1, 16) for x in xs]))]
    total = sum((y * g.reshape(-1, 16)).sum() for y, g in zip(ys[0].split([x.shape[0] * x.shape[1] for x in xs]),
                                                               [g for _, g in batches], strict=True))
    total.backward()
    out = ys[0].detach().split([x.shape[0] * x.shape[1] for x in xs])
    full = {n: getattr(moe.experts, n) for n in ("w1", "w2", "w3")}
    shared = {n: p.grad for n, p in moe.named_parameters() if n.startswith("shared_experts")}
    counts = update_expert_bias([moe], COEFF)
    return dict(moe=moe, y=[o.view_as(x) for o, x in zip(out, xs, strict=True)], x_grad=[x.grad for x in xs],
                full=full, shared=shared, counts=counts[0], bias=moe.router.expert_bias)


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("name", list(CASES))
def test_expert_parallel_equals_one_process(world, name):
    case, ref = CASES[name], _reference(CASES[name])
    per_rank = 8 // case["ep"]
    for rank, results in enumerate(world):
        got = results[name]
        want = "NodeDispatcher" if case.get("gpus_per_node") else "AllToAllDispatcher"
        assert got["dispatcher"] == want, f"rank {rank}: {name} ran through {got['dispatcher']}"
        lo = got["ep_rank"] * per_rank
        for w in ("w1", "w2", "w3"):
            assert torch.equal(got["initial"][w], ref["full"][w].detach()[lo:lo + per_rank]), (
                f"rank {rank}: experts.{w} does not start as the single process's experts {lo}..{lo + per_rank - 1}")
            _close(got["expert_grads"][w], ref["full"][w].grad[lo:lo + per_rank], f"rank {rank} experts.{w}.grad")
        _close(got["y"], ref["y"][rank], f"rank {rank} output")
        _close(got["x_grad"], ref["x_grad"][rank], f"rank {rank} input gradient")
        _close(got["gate_grad"], ref["moe"].router.gate.weight.grad, f"rank {rank} router gradient")
        for n, grad in ref["shared"].items():
            _close(got["shared_grads"][n], grad, f"rank {rank} {n}.grad")
        assert torch.equal(got["counts"], ref["counts"]), f"rank {rank}: token counts over the world"
        assert torch.equal(got["bias"], ref["bias"]), f"rank {rank}: bias after the update"
    for expert in (e for e, v in case["bias"].items() if v < -1e6):
        assert ref["counts"][expert] == 0, "the case must leave an expert without tokens"


def test_experts_not_divisible_by_ep_are_refused_in_one_line_on_every_rank(world):
    for results in world:
        assert results["refusal"] == "moe num_experts=6 is not divisible by the expert-parallel degree 4"


def test_two_hop_nodes_that_do_not_split_ep_evenly_are_refused_on_every_rank(world):
    for results in world:
        assert results["two_hop_refusal"] == (
            "--moe.dispatch_gpus_per_node=3: the expert-parallel ranks [0, 1, 2, 3] are not spread evenly over nodes "
            "of that many consecutive ranks; set it to the GPUs per node of this cluster, or 0 for one hop")


def test_bitwise_where_it_can_be(world):
    """The output and input gradient of EP 4 (softmax case) equal one process bit for bit on CPU."""
    ref = _reference(CASES["ep4_softmax"])
    for rank, results in enumerate(world):
        assert torch.equal(results["ep4_softmax"]["y"], ref["y"][rank]), f"rank {rank}: output not bitwise"


# The rows' exchanges and the shared experts, in the order they ran on each rank. "exchange": a blocking one
# (issued and waited at once); "issue" / "wait": the dispatch's halves (in backward, the wait's backward issues the
# gradient's reverse exchange and the issue's backward waits for it). Combine's exchange stays blocking.
OVERLAPPED = ["issue forward", "shared forward", "wait forward", "exchange forward", "backward",
              "exchange backward", "wait backward", "shared backward", "shared backward done", "issue backward"]
SERIAL = ["exchange forward", "exchange forward", "shared forward", "backward",
          "shared backward", "shared backward done", "exchange backward", "exchange backward"]


def test_shared_experts_run_while_the_dispatch_travels(world):
    """With ``overlap_all_to_all`` the shared experts run between the dispatch's issue and its wait, in forward and
    in backward; without it, after the exchanges in forward (as before); the output and every gradient are the same
    bit for bit either way."""
    for rank, results in enumerate(world):
        on, off = results["overlap"][True], results["overlap"][False]
        assert on["events"] == OVERLAPPED, f"rank {rank}: overlapped order {on['events']}"
        assert off["events"] == SERIAL, f"rank {rank}: serial order {off['events']}"
        assert torch.equal(on["y"], off["y"]), f"rank {rank}: output differs with the overlap"
        assert torch.equal(on["x_grad"], off["x_grad"]), f"rank {rank}: input gradient differs with the overlap"
        assert on["grads"].keys() == off["grads"].keys()
        for name, grad in off["grads"].items():
            assert torch.equal(on["grads"][name], grad), f"rank {rank}: {name}.grad differs with the overlap"


def test_two_hop_dispatch_runs_the_shared_experts_while_the_first_hop_travels(world):
    """Two-hop dispatch with ``overlap_all_to_all``: the shared experts run between the first hop's issue and its
    wait in forward, and between the wait's backward (which issues the gradients' way back) and the issue's backward
    (which waits for it); the output and every gradient are the same bit for bit as without the overlap."""
    for rank, results in enumerate(world):
        on, off = results["two_hop_overlap"][True], results["two_hop_overlap"][False]
        events = on["events"]
        order = [events.index(e) for e in ("issue forward", "shared forward", "wait forward", "backward",
                                            "wait backward", "shared backward done", "issue backward")]
        assert order == sorted(order), f"rank {rank}: two-hop overlapped order {events}"
        assert off["events"].index("shared forward") > off["events"].index("wait forward"), (
            f"rank {rank}: without the overlap the shared experts ran before the rows arrived: {off['events']}")
        assert torch.equal(on["y"], off["y"]), f"rank {rank}: output differs with the overlap"
        for name, grad in off["grads"].items():
            assert torch.equal(on["grads"][name], grad), f"rank {rank}: {name}.grad differs with the overlap"


def test_two_hop_nodes_other_than_the_launchers_are_said():
    from torchtitan.models.moe.parallel import launcher_node_mismatch

    assert launcher_node_mismatch(8, None) is None and launcher_node_mismatch(8, "8") is None
    assert launcher_node_mismatch(2, "4") == (
        "--moe.dispatch_gpus_per_node=2, but the launcher runs 4 ranks per node: the two hops follow the option (the "
        "same model), not the machines' nodes; set it to the GPUs per node")
