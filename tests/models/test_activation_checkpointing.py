"""AC really recomputes: the checkpointed blocks run their forward again during backward."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

from torchtitan.distributed.activation_checkpoint import apply_activation_checkpointing
from torchtitan.models import get_model_spec, model_args
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.llama3 import ModelArgs

ARGS = ModelArgs(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, max_seq_len=8)


def _forward_calls(mode: str, option: str) -> tuple[list[int], dict[str, torch.Tensor], list[str]]:
    torch.manual_seed(0)
    model = Decoder(ARGS)
    model.init_weights()
    apply_activation_checkpointing(model, mode, option) if mode != "none" else None
    calls = [0] * ARGS.n_layers
    for i, block in enumerate(model.layers.values()):
        # A pre-hook: recomputation stops early once the last saved tensor exists, so a post-hook may not run.
        block.feed_forward.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    model(torch.arange(8).view(1, 8)).square().mean().backward()
    return calls, {n: p.grad for n, p in model.named_parameters()}, [n for n, _ in model.named_parameters()]


@pytest.mark.parametrize(
    "mode,option,expected",
    [("full", "op", [2, 2, 2, 2]), ("selective", "2", [1, 2, 1, 2]), ("selective", "op", [2, 2, 2, 2])],
)
def test_checkpointed_blocks_recompute_and_keep_fqns_and_grads(mode, option, expected):
    base_calls, base_grads, base_names = _forward_calls("none", "")
    calls, grads, names = _forward_calls(mode, option)
    assert base_calls == [1, 1, 1, 1]
    assert calls == expected
    assert names == base_names  # no wrapper module: checkpoints and init see the same FQNs
    for name in base_names:
        torch.testing.assert_close(grads[name], base_grads[name], rtol=0, atol=0)


def test_bad_selective_option_is_rejected():
    with pytest.raises(ValueError, match="use 'op', 'moe', 'exchange' or a positive integer"):
        apply_activation_checkpointing(Decoder(ARGS), "selective", "zero")


class _CountProducts(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the linear products (aten.mm) that run, forward and backward together."""

    def __init__(self):
        super().__init__()
        self.products = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.products += func is torch.ops.aten.mm.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "mode,option,recomputed_per_block", [("none", "", 0), ("full", "op", 6), ("selective", "op", 3)])
def test_op_level_ac_recomputes_every_second_linear_product(mode, option, recomputed_per_block):
    """A block has 7 linears (wq wk wv wo w1 w3 w2); op-level AC keeps the 1st, 3rd, ... and recomputes wk wo w3.

    Full AC recomputes 6: the recompute stops once the last tensor backward needs exists (w2's input).
    """
    torch.manual_seed(0)
    model = Decoder(ARGS)
    model.init_weights()
    if mode != "none":
        apply_activation_checkpointing(model, mode, option)
    with _CountProducts() as count:
        model(torch.arange(8).view(1, 8)).square().mean().backward()
    linears = 7 * ARGS.n_layers + 1  # the blocks' and the output's: one forward and two backward products each
    assert count.products == 3 * linears + recomputed_per_block * ARGS.n_layers


def test_layers_that_are_not_a_module_dict_are_refused_by_name():
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
    with pytest.raises(TypeError, match=r"Module.layers, a ModuleList here: .* an nn.ModuleDict"):
        apply_activation_checkpointing(model, "full", "")


class _CountBackwardProducts(torch.utils._python_dispatch.TorchDispatchMode):
    """The linear and grouped products that run (entered for backward only: what it recomputes shows)."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten._grouped_mm.default):
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


MOE_DEBUG_MODELS = {"deepseek_v3": ("debugmodel", {"n_layers": 3}), "qwen3": ("debugmodel_moe", {})}


def _moe_backward(name: str, option: str | None) -> tuple[torch.Tensor, dict, collections.Counter, torch.nn.Module]:
    flavor, changes = MOE_DEBUG_MODELS[name]
    args = dataclasses.replace(model_args(name, flavor), vocab_size=256, **changes)
    torch.manual_seed(0)
    model = get_model_spec(name).build(args)
    model.init_weights()
    if option is not None:  # "full", or a selective option
        apply_activation_checkpointing(model.train(), "full" if option == "full" else "selective", option)
    loss = model(torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))).square().mean()
    with _CountBackwardProducts() as count:
        loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, count.ops, model


@pytest.mark.parametrize("name", list(MOE_DEBUG_MODELS))
def test_moe_policy_recomputes_the_router_and_up_projections_only_and_trains_the_same_model(name):
    """'moe' on the DeepSeek-V3 (MLA, a dense first block) and Qwen3-MoE debug models: the loss and every
    gradient bitwise as without AC; backward reruns exactly the router's and MLA's up-projections' products
    (one each), no grouped expert GEMM (kept)."""
    loss, grads, plain, _ = _moe_backward(name, None)
    moe_loss, moe_grads, recomputing, model = _moe_backward(name, "moe")
    assert torch.equal(moe_loss, loss)
    assert moe_grads.keys() == grads.keys()
    for fqn, grad in grads.items():
        assert torch.equal(moe_grads[fqn], grad), fqn
    marked = [n for n, _ in model.named_modules() if n.endswith((".router", ".wq_b", ".wkv_b"))]
    assert any(n.endswith(".router") for n in marked)
    extra = {op: recomputing[op] - plain[op] for op in plain}
    assert extra == {"aten.mm.default": len(marked), "aten._grouped_mm.default": 0}, (extra, marked)


@pytest.mark.parametrize("name", list(MOE_DEBUG_MODELS))
def test_exchange_policy_without_expert_parallelism_recomputes_every_product_and_trains_the_same_model(name):
    """'exchange' keeps only the expert all-to-alls' outputs; with every expert on the rank there are none, so
    backward reruns every product of the forward, as full AC does, and the model is the same bit for bit."""
    loss, grads, plain, _ = _moe_backward(name, None)
    ex_loss, ex_grads, recomputing, _ = _moe_backward(name, "exchange")
    assert torch.equal(ex_loss, loss)
    for fqn, grad in grads.items():
        assert torch.equal(ex_grads[fqn], grad), fqn
    _, _, full, _ = _moe_backward(name, "full")
    assert recomputing == full and recomputing["aten._grouped_mm.default"] > plain["aten._grouped_mm.default"], (
        recomputing, full, plain)


@pytest.mark.parametrize("option", ["op", "moe", "exchange"])
def test_per_op_ac_ignores_profiler_ranges_that_differ_in_the_recompute(option):
    """FSDP's hooks on a unit inside a block (the expert-parallel experts) open more ``record_function`` ranges
    in the recompute than in the forward under a pipeline: the per-op policies still recompute (it failed with
    "profiler._record_function_enter_new ... not found in storage", as the planner's PP x EP dry run did)."""
    torch.manual_seed(0)
    model = Decoder(ARGS)
    model.init_weights()
    apply_activation_checkpointing(model, "selective", option)
    calls = collections.Counter()

    def in_recompute_only(module, args):  # a range on the second run of each feed-forward (its recompute)
        calls[id(module)] += 1
        if calls[id(module)] == 2:
            with torch.profiler.record_function("unit already unsharded"):
                pass

    for block in model.layers.values():
        block.feed_forward.register_forward_pre_hook(in_recompute_only)
    model(torch.arange(8).view(1, 8)).square().mean().backward()
    assert set(calls.values()) == {2}  # every block recomputed, through the extra range
