"""The eager-CPU kernels (torchtitan/ops/cpu_kernels.py) against the math they stand in for.

- one eligibility rule: each kernel runs on eager CPU tensors and hands anything else (another
  device, code being compiled) to the plain math;
- the linear switch replaces modules over the same parameters: same FQNs, state dict and tied weights;
  the attention kernels are the backend's (``cpu_kernels``), and with only them on a model's output
  is bitwise the plain math's;
- each kernel: oneDNN linears agree with float64 to rounding (every product on oneDNN, selective
  AC keeps their outputs); complex RoPE is the real formula bitwise; grouped-query SDPA gives the
  same output bitwise and K/V gradients to rounding; sliced cross-entropy gives the one-call
  gradient bitwise and its value to rounding.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from torchtitan.distributed.activation_checkpoint import apply_activation_checkpointing
from torchtitan.loss import IGNORE_INDEX, cross_entropy_sum
from torchtitan.models.attention import AttentionBackend, select_backend
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.layers import precompute_rope_cache, repeat_kv, rotate_pairs
from torchtitan.models.llama3 import ModelArgs
from torchtitan.ops import cpu_kernels
from torchtitan.ops.cpu_kernels import (
    CROSS_ENTROPY_SLICE_BYTES,
    OneDNNLinear,
    onednn_available,
    rotate_pairs_complex,
    use_onednn_linears,
)

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")
ONEDNN_OP = torch.ops.mkldnn._linear_pointwise.default
ARGS = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, max_seq_len=8)
aten = torch.ops.aten


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))


def _model(onednn_linears: bool | None) -> Decoder:
    """The small model, initialised; with its CPU kernels switched on unless ``onednn_linears`` is None."""
    torch.manual_seed(0)
    model = Decoder(ARGS)
    model.init_weights()
    if onednn_linears is not None:
        if onednn_linears:
            use_onednn_linears(model)
        model.use_attention_backend(_cpu_attention())
    return model


def _onednn_linear(in_features: int, out_features: int, bias: bool) -> OneDNNLinear:
    parent = torch.nn.Sequential(torch.nn.Linear(in_features, out_features, bias=bias))
    assert use_onednn_linears(parent) == 1
    assert type(parent[0]) is OneDNNLinear
    return parent[0]


def _cpu_attention() -> AttentionBackend:
    return select_backend("auto", "causal", "cpu", cpu_kernels=True)


# ---------------------------------------------------------------- one eligibility rule


def _run_linear(device: str):
    linear = _onednn_linear(16, 8, bias=False).to(device)
    return lambda: linear(torch.randn(4, 16, device=device))


def _run_rotary(device: str):
    attention, cache = _cpu_attention(), precompute_rope_cache(8, 8, 10000.0).to(device)
    x = torch.randn(2, 8, 4, 8, device=device)
    return lambda: attention.rotate(x, x, cache)


def _run_sdpa(device: str):
    attention = _cpu_attention()
    q, kv = torch.randn(1, 4, 8, 8, device=device), torch.randn(1, 2, 8, 8, device=device)
    return lambda: attention.attend(q, kv, kv, None)


def _run_cross_entropy(device: str):
    vocab = 512
    rows = 3 * CROSS_ENTROPY_SLICE_BYTES // (vocab * 4)  # three slices on CPU
    logits, labels = torch.randn(1, rows, vocab, device=device), torch.randint(0, vocab, (1, rows), device=device)
    return lambda: cross_entropy_sum(logits, labels)


# kernel -> (its build, an op whose count tells the CPU kernel from the math, that count under the kernel)
KERNELS = {
    "onednn_linear": (_run_linear, ONEDNN_OP, 1),
    "complex_rope": (_run_rotary, aten.view_as_complex.default, 2),
    "gqa_sdpa": (_run_sdpa, aten.expand.default, 0),  # the math repeats k and v (expand); the kernel does not
    "sliced_cross_entropy": (_run_cross_entropy, aten._log_softmax.default, 3),  # the math: one call
}


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("case", ["eager_cpu", "other_device", "compiling"])
def test_each_kernel_runs_only_where_the_one_rule_holds(kernel, case, monkeypatch):
    build, op, on_kernel = KERNELS[kernel]
    if kernel == "onednn_linear" and not onednn_available():
        pytest.skip("this torch build has no oneDNN")
    run = build("meta" if case == "other_device" else "cpu")
    if case == "compiling":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert cpu_kernels.eager_cpu(torch.ones(1, device="meta" if case == "other_device" else "cpu")) == \
        (case == "eager_cpu")
    with _CountOps() as ops:
        run()
    assert (ops.counts[op] == on_kernel) == (case == "eager_cpu"), dict(ops.counts)


# ---------------------------------------------------------------- the switch


@needs_onednn
def test_the_switch_replaces_linears_over_the_same_parameters_and_state_dict():
    model = _model(None)
    params = {name: p for name, p in model.named_parameters()}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tokens = torch.arange(16).view(2, 8) % ARGS.vocab_size
    expected = model(tokens)
    assert use_onednn_linears(model) == 7 * ARGS.n_layers + 1  # q k v o w1 w2 w3; output
    assert all(type(m) is OneDNNLinear for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert all(p is params[name] for name, p in model.named_parameters())  # the same parameter objects
    state = model.state_dict()
    assert list(state) == list(before) and all(torch.equal(state[k], before[k]) for k in before)
    torch.testing.assert_close(model(tokens), expected, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_the_switch_keeps_a_tied_output_tied():
    model = Decoder(dataclasses.replace(ARGS, tie_word_embeddings=True))
    use_onednn_linears(model)
    assert model.output is not None and model.tok_embeddings is not None
    assert type(model.output) is OneDNNLinear and model.output.weight is model.tok_embeddings.weight


def test_attention_kernels_alone_give_the_plain_models_output_bitwise():
    tokens = torch.arange(16).view(2, 8) % ARGS.vocab_size
    plain, with_kernels = _model(None), _model(onednn_linears=False)
    assert with_kernels.attention_backend is not None and with_kernels.attention_backend.cpu_kernels
    assert all(type(m) is torch.nn.Linear for m in with_kernels.modules() if isinstance(m, torch.nn.Linear))
    assert torch.equal(plain(tokens), with_kernels(tokens))


# ---------------------------------------------------------------- each kernel


@needs_onednn
@pytest.mark.parametrize("shape,bias", [((64, 48), False), ((3, 20, 48), True)])
def test_onednn_values_and_gradients_agree_with_float64(shape, bias):
    torch.manual_seed(0)
    linear = _onednn_linear(48, 40, bias)
    x = torch.randn(*shape, requires_grad=True)
    # strided, as autograd may give
    grad_out = torch.randn(*shape[:-1], 40).transpose(-1, -2).contiguous().transpose(-1, -2)
    with _CountOps() as ops:
        y = linear(x)
        y.backward(grad_out)
    assert ops.counts[ONEDNN_OP] == 3  # forward, dL/dx, dL/dW: every product on oneDNN
    assert ops.counts[aten.mm.default] == 0
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


@needs_onednn
def test_onednn_other_dtypes_and_frozen_inputs_take_the_usual_paths():
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


@needs_onednn
@pytest.mark.parametrize("mode,option,recomputed", [("none", "", 0), ("selective", "op", 3), ("full", "op", 7)])
def test_selective_ac_keeps_the_onednn_outputs(mode, option, recomputed):
    """Per linear: one forward product and two backward ones, plus the recomputed forwards per block
    (op-level AC: wk, wo, w3; full AC: all seven)."""
    model = _model(onednn_linears=True)
    if mode != "none":
        apply_activation_checkpointing(model, mode, option)
    with _CountOps() as ops:
        model(torch.arange(8).view(1, 8)).square().mean().backward()
    block_linears, output = 7 * ARGS.n_layers, 1
    assert ops.counts[ONEDNN_OP] == (block_linears + output) * 3 + recomputed * ARGS.n_layers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_sample", [False, True])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])  # bf16: a cast model's buffer
def test_complex_rotation_is_the_real_rotation_bitwise(dtype, per_sample, cache_dtype):
    """One complex product gives the real formula's values and gradients bit for bit."""
    torch.manual_seed(0)
    cache = precompute_rope_cache(16, 64, 500000.0)
    if per_sample:  # [B, L, head_dim]: positions per sample, as context parallelism passes them
        cache = cache[torch.stack([torch.arange(32), torch.arange(32, 64)])]
    else:
        cache = cache[:32]
    cos, sin = cache.to(cache_dtype).unsqueeze(-2).chunk(2, dim=-1)
    x = torch.randn(2, 32, 4, 16).to(dtype).requires_grad_()
    upstream = torch.randn(2, 32, 4, 16).to(dtype)
    results = []
    for rotate in (lambda t: rotate_pairs(t, cos, sin),
                   lambda t: rotate_pairs_complex(t, torch.complex(cos.float(), sin.float()))):
        x.grad = None
        out = rotate(x)
        out.backward(upstream)
        results.append((out.detach(), x.grad))
    assert results[0][0].dtype == dtype
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


def test_grouped_query_attention_matches_repeated_heads():
    """The kernel reads the K/V heads in place: the same forward bitwise, k/v grads to rounding."""
    torch.manual_seed(0)
    q = torch.randn(2, 8, 64, 16, requires_grad=True)
    k = torch.randn(2, 2, 64, 16, requires_grad=True)
    v = torch.randn(2, 2, 64, 16, requires_grad=True)
    upstream = torch.randn(2, 8, 64, 16)
    results = []
    for fn in (lambda: _cpu_attention().attend(q, k, v, None),
               lambda: F.scaled_dot_product_attention(q, repeat_kv(k, 4), repeat_kv(v, 4), is_causal=True)):
        q.grad = k.grad = v.grad = None
        out = fn()
        out.backward(upstream)
        results.append((out.detach(), q.grad, k.grad, v.grad))
    assert torch.equal(results[0][0], results[1][0])  # same forward bitwise
    for a, b in zip(results[0][1:], results[1][1:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _one_call(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)


def test_sliced_cross_entropy_has_the_one_call_gradient_bitwise():
    torch.manual_seed(0)
    logits = torch.randn(3, 700, 512)  # 2100 rows of 2 KiB: several 1 MiB slices and a short last one
    labels = torch.randint(0, 512, (3, 700))
    labels[0, :5] = IGNORE_INDEX
    assert logits.shape[0] * logits.shape[1] > 3 * CROSS_ENTROPY_SLICE_BYTES // (512 * 4)  # the sliced branch runs
    grads = []
    for fn in (cross_entropy_sum, _one_call):
        x = logits.clone().requires_grad_()
        value = fn(x, labels)
        (value * 0.37).backward()
        grads.append((value.detach(), x.grad))
    assert torch.equal(grads[0][1], grads[1][1])
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-6, atol=0)
