"""oneDNN linear layers on CPU: the same values and gradients as ``F.linear`` up to float32 rounding,
the same parameters and state dict, ``F.linear`` itself wherever oneDNN does not apply, and
selective AC keeps their outputs like any other matrix product."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from torchtitan.models.cpu_linear import OneDNNLinear, onednn_available, use_onednn_linears
from torchtitan.models.llama3 import ModelArgs, Transformer
from torchtitan.models.llama3.parallelize import apply_activation_checkpointing

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")
ONEDNN_OP = torch.ops.mkldnn._linear_pointwise.default
ARGS = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, max_seq_len=8)


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))


def _onednn_linear(in_features: int, out_features: int, bias: bool) -> OneDNNLinear:
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    assert use_onednn_linears(linear) == 1 and type(linear) is OneDNNLinear
    return linear


@pytest.mark.parametrize("shape,bias", [((64, 48), False), ((3, 20, 48), True)])
def test_values_and_gradients_agree_with_float64(shape, bias):
    torch.manual_seed(0)
    linear = _onednn_linear(48, 40, bias)
    x = torch.randn(*shape, requires_grad=True)
    grad_out = torch.randn(*shape[:-1], 40).transpose(-1, -2).contiguous().transpose(-1, -2)  # strided, as autograd may give
    with _CountOps() as ops:
        y = linear(x)
        y.backward(grad_out)
    assert ops.counts[ONEDNN_OP] == 3  # forward, dL/dx, dL/dW: every product on oneDNN
    assert ops.counts[torch.ops.aten.mm.default] == 0
    x64, w64 = x.detach().double().requires_grad_(), linear.weight.detach().double().requires_grad_()
    b64 = linear.bias.detach().double().requires_grad_() if bias else None
    y64 = F.linear(x64, w64, b64)
    y64.backward(grad_out.double())
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.double(), y64, **tol)
    torch.testing.assert_close(x.grad.double(), x64.grad, **tol)
    torch.testing.assert_close(linear.weight.grad.double(), w64.grad, **tol)
    if bias:
        torch.testing.assert_close(linear.bias.grad.double(), b64.grad, **tol)


def test_other_dtypes_and_frozen_inputs_take_the_usual_paths():
    torch.manual_seed(0)
    linear = _onednn_linear(16, 8, bias=False)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    with _CountOps() as ops:
        y = linear.to(torch.bfloat16)(x)
    assert ops.counts[ONEDNN_OP] == 0
    assert torch.equal(y, F.linear(x, linear.weight))
    # Only the gradients asked for are computed: a frozen weight costs no dL/dW product.
    linear = _onednn_linear(16, 8, bias=False).requires_grad_(False)
    x = torch.randn(4, 16, requires_grad=True)
    with _CountOps() as ops:
        linear(x).sum().backward()
    assert ops.counts[ONEDNN_OP] == 2


def test_a_model_keeps_its_parameters_and_state_dict():
    torch.manual_seed(0)
    model = Transformer(ARGS)
    model.init_weights()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tokens = torch.arange(16).view(2, 8) % ARGS.vocab_size
    expected = model(tokens)
    assert use_onednn_linears(model) == 7 * ARGS.n_layers + 1  # q, k, v, o, w1, w2, w3 per block; the output
    state = model.state_dict()
    assert list(state) == list(before) and all(torch.equal(state[k], before[k]) for k in before)
    torch.testing.assert_close(model(tokens), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode,option,products", [("none", "", 3), ("selective", "op", 3), ("full", "op", 4)])
def test_selective_ac_keeps_the_onednn_outputs(mode, option, products):
    """Per linear layer: one forward product and two backward ones; only full AC runs the forward again."""
    torch.manual_seed(0)
    model = Transformer(ARGS)
    model.init_weights()
    use_onednn_linears(model)
    if mode != "none":
        apply_activation_checkpointing(model, mode, option)
    with _CountOps() as ops:
        model(torch.arange(8).view(1, 8)).square().mean().backward()
    block_linears, output = 7 * ARGS.n_layers, 1
    assert ops.counts[ONEDNN_OP] == block_linears * products + output * 3
