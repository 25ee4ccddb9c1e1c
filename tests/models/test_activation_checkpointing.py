"""AC really recomputes: the checkpointed blocks run their forward again during backward."""

from __future__ import annotations

import pytest
import torch

from torchtitan.distributed.activation_checkpoint import apply_activation_checkpointing
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
    with pytest.raises(ValueError, match="use 'op' or a positive integer"):
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
