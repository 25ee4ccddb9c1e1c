"""The MoE feed-forward in one process: routing, experts, dispatch, counts, balancing, auxiliary losses.

Expert parallelism over real gloo ranks: tests/distributed/test_moe_expert_parallel.py.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from torchtitan import compat
from torchtitan.compat import kernels as compat_kernels
from torchtitan.distributed.layout_init import init_params_layout_invariant
from torchtitan.models.expert_balance import imbalance, update_expert_bias
from torchtitan.models.moe import MoE, MoEArgs
from torchtitan.models.moe.balance import sequence_aux_loss, switch_aux_loss
from torchtitan.models.moe.experts import GroupedExperts, grouped_mm_fits
from torchtitan.models.moe.router import TokenChoiceRouter

# ---------------------------------------------------------------- references, written the plain way


def reference_route(logits: torch.Tensor, top_k: int, score_func: str, norm: bool, scale: float,
                    groups: int = 1, topk_groups: int = 1, bias: torch.Tensor | None = None):
    """Token by token, in float64: the chosen experts (best first) and their weights."""
    chosen, weights = [], []
    for row in logits.double():
        scores = row.softmax(-1) if score_func == "softmax" else row.sigmoid()
        choice = scores + (0 if bias is None else bias.double())
        size = len(scores) // groups
        group_score = [sum(sorted(choice[g * size:(g + 1) * size].tolist(), reverse=True)[:2]) for g in range(groups)]
        kept = sorted(range(groups), key=lambda g: -group_score[g])[:topk_groups]
        allowed = [e for e in range(len(scores)) if e // size in kept]
        experts = sorted(allowed, key=lambda e: -choice[e].item())[:top_k]
        w = scores[experts]
        if norm:
            w = w / w.sum()
        chosen.append(experts)
        weights.append((w * scale).tolist())
    return torch.tensor(chosen), torch.tensor(weights, dtype=torch.float64)


def expert_swiglu(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    return (F.silu(x @ w1.t()) * (x @ w3.t())) @ w2.t()


def dense_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token through its chosen experts one at a time, weighted and summed, plus the shared experts."""
    tokens = x.reshape(-1, x.shape[-1])
    weights, experts, _ = moe.router(tokens)
    e = moe.experts
    out = []
    for t in range(tokens.shape[0]):
        row = sum(weights[t, j] * expert_swiglu(tokens[t], e.w1[i], e.w2[i], e.w3[i])
                  for j, i in enumerate(experts[t].tolist()))
        if moe.shared_experts is not None:
            row = row + moe.shared_experts(tokens[t])
        out.append(row)
    return torch.stack(out).view(x.shape)


def make_moe(seed: int = 0, **overrides) -> MoE:
    args = dict(dim=16, hidden_dim=12, num_experts=8, top_k=2, norm_topk_prob=True)
    args.update(overrides)
    moe = MoE(MoEArgs(**args))
    init_params_layout_invariant(moe, seed)
    return moe


# ---------------------------------------------------------------- router

ROUTER_CASES = [
    dict(score_func="softmax", norm=False, scale=1.0),
    dict(score_func="softmax", norm=True, scale=1.0),
    dict(score_func="sigmoid", norm=True, scale=2.5, groups=4, topk_groups=2),
    dict(score_func="sigmoid", norm=False, scale=16.0, groups=2, topk_groups=1, bias=True),
    dict(score_func="softmax", norm=True, scale=1.0, bias=True),
]


@pytest.mark.parametrize("case", ROUTER_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_router_matches_a_token_by_token_reference(case):
    torch.manual_seed(1)
    groups, topk_groups = case.get("groups", 1), case.get("topk_groups", 1)
    router = TokenChoiceRouter(16, 8, 3, case["score_func"], case["norm"], case["scale"], groups, topk_groups,
                               load_balance_bias=case.get("bias", False))
    torch.nn.init.normal_(router.gate.weight, std=0.5)
    if router.expert_bias is not None:
        router.expert_bias.copy_(torch.randn(8) * 0.3)
    x = torch.randn(40, 16)
    weights, experts, scores = router(x)
    want_experts, want_weights = reference_route(x @ router.gate.weight.t(), 3, case["score_func"], case["norm"],
                                                 case["scale"], groups, topk_groups, router.expert_bias)
    assert torch.equal(experts, want_experts)
    torch.testing.assert_close(weights.double(), want_weights, rtol=1e-6, atol=1e-7)
    assert weights.dtype == scores.dtype == torch.float32


def test_bias_chooses_experts_but_never_weights_them():
    torch.manual_seed(2)
    router = TokenChoiceRouter(16, 8, 2, "sigmoid", load_balance_bias=True)
    x = torch.randn(30, 16)
    router.expert_bias[5] = 100.0  # every token must take expert 5 ...
    weights, experts, scores = router(x)
    assert (experts == 5).any(dim=-1).all()
    picked = experts == 5
    assert torch.equal(weights[picked], scores[:, 5])  # ... at its unbiased score
    assert "expert_bias" in router.state_dict(), "the bias must be checkpointed"


def test_router_computes_in_float32_for_a_bf16_input():
    """A bf16 router scores exactly as a float32 router holding the same (bf16-rounded) values."""
    torch.manual_seed(3)
    router_bf16 = TokenChoiceRouter(16, 8, 2).to(torch.bfloat16)
    router_32 = TokenChoiceRouter(16, 8, 2)
    router_32.gate.weight.data.copy_(router_bf16.gate.weight.float())
    x = torch.randn(10, 16).to(torch.bfloat16)
    w16, e16, s16 = router_bf16(x)
    w32, e32, s32 = router_32(x.float())
    assert s16.dtype == torch.float32 and torch.equal(s16, s32) and torch.equal(w16, w32) and torch.equal(e16, e32)


@pytest.mark.parametrize("kwargs, words", [
    (dict(top_k=9), "top_k=9 must be between 1 and num_experts=8"),
    (dict(num_groups=3), "num_groups=3 must divide num_experts=8"),
    (dict(num_groups=4, topk_groups=1, top_k=3), "top_k=3 exceeds the 2 experts"),
    (dict(score_func="relu"), "score_func='relu' is unknown"),
    (dict(aux_loss="z"), "aux_loss='z' is unknown"),
])
def test_bad_options_are_one_line(kwargs, words):
    args = dict(dim=16, hidden_dim=12, num_experts=8, top_k=2) | kwargs
    with pytest.raises(ValueError, match=words) as info:
        MoE(MoEArgs(**args))
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------- experts


def _experts_pair(dim: int, hidden: int, num_experts: int, dtype=torch.float32):
    torch.manual_seed(4)
    grouped = GroupedExperts(dim, hidden, num_experts, use_grouped_mm=True).to(dtype)
    loop = GroupedExperts(dim, hidden, num_experts, use_grouped_mm=False).to(dtype)
    for name in ("w1", "w2", "w3"):
        value = torch.randn_like(getattr(grouped, name)) * 0.2
        getattr(grouped, name).data.copy_(value)
        getattr(loop, name).data.copy_(value)
    return grouped, loop


def _run(experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor, bare_sum: bool):
    x = x.detach().clone().requires_grad_(True)
    y = experts(x, counts)
    # A bare sum hands grouped_mm's backward a stride-0 gradient, which it refuses unless guarded.
    (y.sum() if bare_sum else (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum()).backward()
    return y, x.grad, [getattr(experts, n).grad for n in ("w1", "w2", "w3")]


@pytest.mark.parametrize("bare_sum", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_equals_the_per_expert_loop(monkeypatch, bare_sum, dtype):
    calls = []
    compat.grouped_mm_supported(torch.device("cpu"), dtype)  # probed before counting
    real = compat.grouped_mm
    monkeypatch.setattr(compat, "grouped_mm", lambda *a: calls.append(1) or real(*a))
    grouped, loop = _experts_pair(16, 24, 5, dtype)
    counts = torch.tensor([3, 0, 7, 1, 0])  # zero-token experts in the middle and at the end
    x = torch.randn(11, 16, dtype=dtype)
    got, want = _run(grouped, x, counts, bare_sum), _run(loop, x, counts, bare_sum)
    assert len(calls) == 3, "the aligned shapes must take torch._grouped_mm (w1, w3, w2)"
    assert got[0]._base is None, "a view output makes FSDP warn that it cannot hook the experts' backward"
    for a, b in zip([got[0], got[1], *got[2]], [want[0], want[1], *want[2]], strict=True):
        assert a.dtype == dtype
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # bit-identical on CPU
    assert got[2][0][[1, 4]].abs().sum() == 0, "experts without tokens get a zero gradient"


@pytest.mark.parametrize("dim, hidden", [(6, 10), (16, 10), (5, 8)])
def test_unaligned_widths_and_no_tokens_take_the_loop(dim, hidden):
    grouped, loop = _experts_pair(dim, hidden, 4)
    assert not grouped_mm_fits(torch.zeros(3, dim), grouped.w1) or not grouped_mm_fits(torch.zeros(3, hidden),
                                                                                         grouped.w2)
    for counts in (torch.tensor([2, 0, 4, 1]), torch.tensor([0, 0, 0, 0])):
        x = torch.randn(int(counts.sum()), dim)
        got, want = _run(grouped, x, counts, True), _run(loop, x, counts, True)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        assert got[0].shape == (x.shape[0], dim)
        assert all(g is not None and g.shape == w.shape for g, w in zip(got[2], (grouped.w1, grouped.w2, grouped.w3),
                                                                       strict=True))


def test_grouped_gemm_probe_says_yes_on_cpu_float32():
    assert grouped_mm_fits(torch.zeros(4, 16), torch.zeros(3, 8, 16)), (
        f"torch {torch.__version__} should run torch._grouped_mm on CPU (2.9+)")
    assert not grouped_mm_fits(torch.zeros(0, 16), torch.zeros(3, 8, 16)), "no rows: the loop"


# ---------------------------------------------------------------- the feed-forward

MOE_CASES = [
    dict(),
    dict(score_func="sigmoid", num_groups=4, topk_groups=2, route_scale=2.5, num_shared_experts=2,
         load_balance_bias=True),
    dict(hidden_dim=10, norm_topk_prob=False, top_k=3),  # unaligned: the loop
]


@pytest.mark.parametrize("case", MOE_CASES, ids=["qwen3", "deepseek", "unaligned"])
def test_forward_equals_a_dense_per_token_reference(case):
    moe = make_moe(**case)
    if moe.router.expert_bias is not None:
        moe.router.expert_bias.copy_(torch.linspace(-0.2, 0.2, 8))
    x = torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(5))
    y = moe(x)
    torch.testing.assert_close(y, dense_reference(moe, x), rtol=1e-5, atol=1e-6)
    assert int(moe.tokens_per_expert.sum()) == 21 * moe.args.top_k


def test_an_expert_without_tokens_gets_a_zero_gradient_and_the_output_is_right():
    moe = make_moe(load_balance_bias=True)
    moe.router.expert_bias[3] = -1e9  # nobody chooses expert 3
    x = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(6))
    y = moe(x)
    (y * torch.randn_like(y)).sum().backward()
    assert moe.tokens_per_expert[3] == 0
    assert moe.experts.w1.grad[3].abs().sum() == 0 and moe.experts.w1.grad.abs().sum() > 0
    torch.testing.assert_close(y, dense_reference(moe, x), rtol=1e-5, atol=1e-6)


def test_output_keeps_the_input_dtype_and_experts_compute_in_the_parameter_dtype():
    moe = make_moe().to(torch.bfloat16)
    y = moe(torch.randn(2, 4, 16, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16


def _slot_loop(slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The weighted sum of the slots as plain autograd runs it: slot by slot in float32."""
    wide, w = slots.float(), weights.float()
    total = wide[:, 0] * w[:, :1]
    for slot in range(1, slots.shape[1]):
        total = total + wide[:, slot] * w[:, slot : slot + 1]
    return total.to(slots.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_backward_equals_autograds_and_writes_no_slot_sized_buffer_per_slot(dtype):
    """The combine's own backward: bitwise autograd's through the slot loop, without the per-slot zero-filled
    float32 [T, k, D] buffers (and their k-fold sum) that autograd's select backward writes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from torchtitan.models.moe.dispatch import _WeightedSlotSum

    gen = torch.Generator().manual_seed(3)
    tokens, k, dim = 11, 8, 24
    slots = torch.randn(tokens, k, dim, generator=gen).to(dtype).requires_grad_()
    weights = torch.rand(tokens, k, generator=gen).requires_grad_()
    grad = torch.randn(tokens, dim, generator=gen).to(dtype)

    class SlotSized(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.shape == (tokens, k, dim) and out.dtype == torch.float32:
                self.count += 1
            return out

    expected = torch.autograd.grad(_slot_loop(slots, weights), (slots, weights), grad)
    out = _WeightedSlotSum.apply(slots, weights, dtype)
    assert torch.equal(out, _slot_loop(slots, weights))
    with SlotSized() as seen:
        got = torch.autograd.grad(out, (slots, weights), grad)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert seen.count <= 3, seen.count  # the slots' gradient, the widened slots, their product: not k of each


# ---------------------------------------------------------------- counts


@pytest.mark.parametrize("reentrant", [False, True])
def test_counts_are_not_doubled_by_activation_checkpointing(reentrant):
    plain, ac = make_moe(), make_moe()
    x = torch.randn(2, 10, 16, generator=torch.Generator().manual_seed(7))
    y_plain = plain(x.clone().requires_grad_(True))
    (y_plain * 0.5).sum().backward()
    xa = x.clone().requires_grad_(True)
    y_ac = checkpoint(ac, xa, use_reentrant=reentrant)
    (y_ac * 0.5).sum().backward()
    assert torch.equal(ac.tokens_per_expert, plain.tokens_per_expert), "a recompute counted the tokens again"
    assert int(ac.tokens_per_expert.sum()) == 20 * 2
    assert torch.equal(ac.experts.w1.grad, plain.experts.w1.grad)


def test_the_first_grouped_gemm_inside_a_checkpoint_recomputes_the_same(monkeypatch):
    """torch._grouped_mm's support is probed on first use: here inside a checkpointed forward, whose
    recompute (probe cached) must save the same tensors, or the backward raises CheckpointError."""
    monkeypatch.setattr(compat_kernels, "_GROUPED_MM_PROBED", {})
    moe = make_moe()
    y = checkpoint(moe, torch.randn(2, 8, 16, requires_grad=True), use_reentrant=False)
    y.sum().backward()
    assert compat_kernels._GROUPED_MM_PROBED and moe.experts.w1.grad is not None


def test_counts_add_up_over_micro_batches_and_skip_evaluation():
    moe = make_moe()
    gen = torch.Generator().manual_seed(8)
    batches = [torch.randn(2, 5, 16, generator=gen) for _ in range(3)]
    expected = torch.zeros(8, dtype=torch.int64)
    for x in batches:
        _, experts, _ = moe.router(x.reshape(-1, 16))
        expected += torch.bincount(experts.reshape(-1), minlength=8)
        moe(x).sum().backward()
    assert torch.equal(moe.tokens_per_expert, expected)
    moe.eval()
    with torch.no_grad():
        moe(batches[0])
    assert torch.equal(moe.tokens_per_expert, expected), "evaluation must not count"


# ---------------------------------------------------------------- balancing


def test_bias_update_moves_by_the_sign_and_stays_centred():
    moes = [make_moe(load_balance_bias=True, num_experts=4), make_moe(load_balance_bias=True, num_experts=4),
            make_moe(num_experts=4)]
    moes[0].tokens_per_expert.copy_(torch.tensor([10, 0, 5, 5]))
    moes[1].tokens_per_expert.copy_(torch.tensor([9, 1, 1, 1]))
    moes[2].tokens_per_expert.copy_(torch.tensor([4, 4, 4, 0]))
    totals = update_expert_bias(moes, coeff=0.01)
    assert torch.equal(totals, torch.tensor([[10, 0, 5, 5], [9, 1, 1, 1], [4, 4, 4, 0]]))
    torch.testing.assert_close(moes[0].router.expert_bias, torch.tensor([-0.01, 0.01, 0.0, 0.0]))
    torch.testing.assert_close(moes[1].router.expert_bias, torch.tensor([-0.015, 0.005, 0.005, 0.005]))
    for moe in moes:
        assert moe.tokens_per_expert.sum() == 0
    assert moes[1].router.expert_bias.sum().abs() < 1e-9
    torch.testing.assert_close(imbalance(totals), torch.tensor([2.0, 3.0, 4 / 3], dtype=torch.float64))


def test_balanced_routing_follows_the_bias():
    """Updates on an unbalanced router spread the tokens: the bias does its job."""
    moe = make_moe(load_balance_bias=True, score_func="sigmoid")
    torch.nn.init.normal_(moe.router.gate.weight, std=0.3, generator=torch.Generator().manual_seed(0))
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(9)) + 0.5
    moe(x)
    before = float(imbalance(update_expert_bias([moe], 0.0))[0])
    for _ in range(30):
        moe(x)
        update_expert_bias([moe], coeff=0.01)
    moe(x)
    after = float(imbalance(update_expert_bias([moe], 0.0))[0])
    assert before > 1.5 and after < 1.2, (before, after)


def test_switch_loss_equals_transformers_qwen3_moe():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    router = TokenChoiceRouter(16, 8, 2, norm_topk_prob=True)
    torch.nn.init.normal_(router.gate.weight, std=0.3)
    x = torch.randn(50, 16, generator=torch.Generator().manual_seed(10))
    _, experts, scores = router(x)
    logits = x @ router.gate.weight.t()
    want = load_balancing_loss_func((logits,), num_experts=8, top_k=2)
    torch.testing.assert_close(switch_aux_loss(scores, experts), want, rtol=1e-6, atol=0)


def test_sequence_loss_matches_its_formula():
    router = TokenChoiceRouter(16, 6, 2, score_func="sigmoid")
    x = torch.randn(3 * 5, 16, generator=torch.Generator().manual_seed(11))
    _, experts, scores = router(x)
    total = 0.0
    for b in range(3):  # DeepSeek-V3 eqs. 17-20, one sequence of T=5 tokens at a time
        s, e = scores[b * 5:(b + 1) * 5].double(), experts[b * 5:(b + 1) * 5]
        f = [6 / (2 * 5) * int((e == i).sum()) for i in range(6)]
        p = (s / s.sum(-1, keepdim=True)).mean(0)
        total += sum(f[i] * p[i] for i in range(6))
    torch.testing.assert_close(sequence_aux_loss(scores, experts, 3).double(), total / 3, rtol=1e-6, atol=0)


@pytest.mark.parametrize("kind", ["switch", "sequence"])
def test_aux_loss_is_handed_to_the_model_once_and_trains_with_the_weight_it_is_given(kind):
    """A training forward keeps its loss for its model to take, once; weighed by the step, it adds its gradient."""
    weight = 0.03 * 0.25  # the coefficient over the step's forwards (train_step/aux_loss.py)
    moe, plain = make_moe(aux_loss=kind, aux_loss_coeff=0.03), make_moe()
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(12))
    g = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(13))
    y = moe(x)
    loss = moe.take_aux_loss()
    assert loss is not None and moe.take_aux_loss() is None
    ((y * g).sum() + weight * loss).backward()
    from torchtitan.models.moe.balance import aux_loss

    _, experts, scores = plain.router(x.reshape(-1, 16))
    want = aux_loss(kind, scores, experts, 2)
    assert math.isclose(float(loss.detach()), float(want.detach()), rel_tol=1e-6)
    ((plain(x) * g).sum() + weight * want).backward()
    torch.testing.assert_close(moe.router.gate.weight.grad, plain.router.gate.weight.grad, rtol=1e-6, atol=1e-9)
    without = make_moe()
    (without(x) * g).sum().backward()
    assert not torch.allclose(without.router.gate.weight.grad, moe.router.gate.weight.grad, rtol=1e-4, atol=0), (
        "the auxiliary loss added no gradient")
    moe.eval()
    moe(x)
    assert moe.take_aux_loss() is None  # evaluation keeps none
    assert not make_moe(aux_loss=kind).has_aux_loss  # without a coefficient there is no loss


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3", "gpt_oss"])
def test_overlap_all_to_all_reaches_every_moe_layer(family):
    """``--moe.overlap_all_to_all`` (default on) reaches the MoE layers' arguments through the job's options."""
    from torchtitan.config import job_config
    from torchtitan.models import get_model_spec, model_args

    flavor = "debugmodel_moe" if family == "qwen3" else "debugmodel"
    args, spec = model_args(family, flavor), get_model_spec(family)
    for overlap in (True, False):
        configured = spec.model.with_job_options(args, job_config.Model(), job_config.Moe(overlap_all_to_all=overlap))
        assert configured.moe_args().overlap_all_to_all is overlap, f"{family}: overlap_all_to_all={overlap} lost"
