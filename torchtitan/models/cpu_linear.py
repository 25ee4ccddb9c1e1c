"""Linear layers whose float32 products run on oneDNN, for eager training on CPU.

ATen runs a float32 ``mm`` on the BLAS that torch was built with: MKL on x86. MKL chooses its
kernels by CPU vendor and keeps to AVX2 on AMD CPUs even where AVX-512 exists; oneDNN, which
every x86 build of torch also carries, chooses by instruction set. On the AMD EPYC machine this
project is tested on, oneDNN's products are faster than MKL's at the debug model's shapes,
forward and backward (figures: benchmarks/README.md section 11). Both compute in IEEE float32; the results
differ by rounding only, from a different blocking of the sums.

Only plain float32 CPU tensors take this path. DTensor weights (tensor parallel), other dtypes,
other devices and compiled code keep ``F.linear``, so GPU runs never see it.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

logger = logging.getLogger(__name__)


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


def _takes_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
        and not isinstance(x, DTensor) and not isinstance(weight, DTensor)
        and x.numel() > 0 and not torch.compiler.is_compiling()
    )


class OneDNNLinear(nn.Linear):
    """``nn.Linear`` (same parameters, same state dict) whose float32 CPU products run on oneDNN."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _takes_onednn(x, self.weight):
            return _OneDNNLinearFunction.apply(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def use_onednn_linears(model: nn.Module) -> int:
    """Turn every plain ``nn.Linear`` of ``model`` into an ``OneDNNLinear``, in place; returns how many.

    Changing the class keeps the parameters, their FQNs, the state dict and every hook as they
    are; ``parallelize_llama`` does it first, before the parallelisms. Where torch lacks oneDNN
    nothing changes.
    """
    if not onednn_available():
        logger.warning("This torch build has no oneDNN: float32 linear layers stay on ATen's default kernels")
        return 0
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    for m in linears:
        m.__class__ = OneDNNLinear
    return len(linears)
