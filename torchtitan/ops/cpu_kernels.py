"""Faster eager-CPU kernels for the model's math, behind one switch and one eligibility rule.

The model file states the math (``nn.Linear``, the real-valued RoPE formula, attention over
repeated K/V heads); this module holds what runs instead on a CPU, in eager mode:

- linear layers: float32 products on oneDNN rather than ATen's BLAS (MKL on x86), which picks
  kernels by CPU vendor and keeps to AVX2 on AMD CPUs where oneDNN uses AVX-512
  (``training.cpu_matmul``). Same IEEE float32 products, summed in another blocking: results
  differ by rounding;
- RoPE: one complex product per tensor instead of four real ones and a stack (and their
  backward); bitwise the real formula (applied by the attention backends too);
- grouped-query attention: SDPA reads each K/V head for its query group itself (``enable_gqa``)
  instead of copies repeated per query head; the same output bitwise, K/V gradients to rounding
  (applied by the attention backends, models/attention/backends.py, with ``cpu_kernels``);
- the token cross-entropies: taken in row slices that stay in cache from the log-softmax to
  its gradient; the same gradient bitwise, the summed value to rounding.

What each one saves is measured in benchmarks/history.md §11.

The linear layers' switch is ``use_onednn_linears``, run by ``distributed/parallelize.py`` on CPU before
the parallelisms: each plain ``nn.Linear`` is replaced by a ``OneDNNLinear`` over the same parameters
(FQNs, state dict and tied weights untouched). The attention kernels are chosen with the model's
attention backend (``select_backend``, ``cpu_kernels``). The cross-entropy is reached through
``torchtitan.loss.cross_entropy_sum``. Every kernel applies only where ``eager_cpu`` holds, and
otherwise falls back to the math it stands in for, so DTensors (tensor parallelism), other devices
and code being compiled never see these kernels.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

logger = logging.getLogger(__name__)


def eager_cpu(*tensors: torch.Tensor) -> bool:
    """The one eligibility rule: every tensor a plain (not DTensor) CPU tensor, outside ``torch.compile``."""
    return not torch.compiler.is_compiling() and all(
        t.device.type == "cpu" and not isinstance(t, DTensor) for t in tensors)


# ---------------------------------------------------------------- linear layers on oneDNN


def onednn_available() -> bool:
    """True where this torch build has oneDNN's linear operator (x86 and most Arm builds)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def times_transposed(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b.T`` on oneDNN; ``a`` may have any number of leading dims, both any strides."""
    return torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")


class _OneDNNLinearFunction(torch.autograd.Function):
    """y = x W^T + b, and its backward, every product on oneDNN."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        out = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        # oneDNN hands back a view of its own result for inputs of more than 2 dims. Returned from the model's
        # root (the output layer's logits), FSDP2 warns that an in-place op on a view would skip its pre-backward
        # hook. Nothing else holds that result, so an alias that autograd does not track as a view (what matmul
        # returns itself) is exact and costs no copy.
        return torch.ops.aten._unsafe_view(out, out.shape) if out._base is not None else out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_2d = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = times_transposed(grad_2d, weight.t()).view(x.shape)  # dL/dx = g W
        if ctx.needs_input_grad[1]:
            # dL/dW = g^T x. Transposing g into a copy first is faster than letting oneDNN read it strided.
            grad_weight = times_transposed(grad_2d.t().contiguous(), x.reshape(-1, x.shape[-1]).t())
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_2d.sum(0)
        return grad_x, grad_weight, grad_bias


class OneDNNLinear(nn.Linear):
    """``nn.Linear`` (same parameters, same state dict) whose float32 CPU products run on oneDNN."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # oneDNN's path is written for float32 only; an empty input has no product to speed up.
        if eager_cpu(x, self.weight) and x.dtype == self.weight.dtype == torch.float32 and x.numel() > 0:
            return _OneDNNLinearFunction.apply(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


# ---------------------------------------------------------------- attention: RoPE and grouped-query SDPA


def rotate_pairs_complex(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """The model's ``rotate_pairs`` as a complex product: pair (x0, x1) is x0 + i x1, ``rotation`` cos + i sin.

    One complex multiply per tensor, forward and backward, instead of four real ones, a stack and
    their backward; the same products and sums, so the same values and gradients bitwise
    (tests/ops/test_cpu_kernels.py).
    """
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)).contiguous())
    return torch.view_as_real(pairs * rotation).flatten(-2).type_as(x)


# ---------------------------------------------------------------- the token cross-entropies

# Logits are scored in slices of about this many bytes: one call over the whole [tokens, vocab]
# block streams it (and its softmax and gradient, each as large) through memory several times,
# while a slice stays in cache from the log-softmax to its gradient.
CROSS_ENTROPY_SLICE_BYTES = 1 << 20


def cross_entropy_sum_sliced(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor | None:
    """The sum of the token cross-entropies of [tokens, vocab] ``logits``, in row slices; None where the
    rule or the size says one call is as good (the caller makes it).

    Each row's gradient is the same bitwise either way (softmax minus one-hot, times the upstream
    scale); only the order in which the sum adds the rows differs, i.e. the value by rounding.
    """
    rows = max(1, CROSS_ENTROPY_SLICE_BYTES // (logits.shape[-1] * logits.element_size()))
    if not eager_cpu(logits) or logits.shape[0] <= rows:
        return None
    sums = [F.cross_entropy(part, target, reduction="sum", ignore_index=ignore_index)
            for part, target in zip(logits.split(rows), labels.split(rows))]
    return torch.stack(sums).sum()


# ---------------------------------------------------------------- the switch for linear layers


def onednn_linear_of(linear: nn.Linear) -> OneDNNLinear:
    """A ``OneDNNLinear`` holding ``linear``'s own parameters (the same objects: ties and FQNs stay)."""
    new = OneDNNLinear.__new__(OneDNNLinear)
    nn.Module.__init__(new)
    new.in_features, new.out_features = linear.in_features, linear.out_features
    # nn.Linear types them as tensors; they are its registered parameters (bias: or None).
    weight, bias = linear.weight, linear.bias
    assert isinstance(weight, nn.Parameter) and (bias is None or isinstance(bias, nn.Parameter)), \
        "nn.Linear registers its weight and bias as parameters"
    new.register_parameter("weight", weight)
    new.register_parameter("bias", bias)
    return new


def use_onednn_linears(model: nn.Module) -> int:
    """Replace every plain ``nn.Linear`` child of ``model`` by a ``OneDNNLinear`` over the same parameters;
    how many. The state dict, the FQNs and tied weights are unchanged; no hooks are on the model yet
    (``distributed/parallelize.py`` runs this first). A torch without oneDNN keeps ATen's kernels (0).
    """
    if not onednn_available():
        logger.warning("This torch build has no oneDNN: float32 linear layers stay on ATen's default kernels")
        return 0
    replaced: dict[int, OneDNNLinear] = {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                if id(child) not in replaced:
                    replaced[id(child)] = onednn_linear_of(child)
                parent.register_module(name, replaced[id(child)])
    return len(replaced)
