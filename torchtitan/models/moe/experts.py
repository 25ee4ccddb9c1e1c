"""Routed experts stored stacked, computed as one grouped GEMM per weight where the shapes allow.

``GroupedExperts`` holds ``w1 [E, F, D]`` (gate), ``w2 [E, D, F]`` (down) and ``w3 [E, F, D]``
(up); expert ``e`` computes the SwiGLU ``w2[e] (silu(w1[e] x) * w3[e] x)``. Its input is the
tokens already grouped by expert (``counts[e]`` rows each, in expert order).

``torch._grouped_mm`` takes int32 offsets and row strides that are multiples of 16 bytes,
and its backward fails on a stride-0 incoming gradient (``y.sum().backward()``). Where the
op is missing, the widths are unaligned or there is no token, the exact per-expert loop
runs instead, so no shape is refused. On CPU both give the same bits (tests/models/test_moe.py).
Compute stays in the parameter dtype: on CPU bf16 products are many times slower than fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan import compat
from torchtitan.models.moe.float8_experts import fp8_grouped_mm, fp8_grouped_mm_runs


def _contiguous(grad: torch.Tensor) -> torch.Tensor:
    return grad.contiguous()


class _ScaleGrad(torch.autograd.Function):
    """Identity whose backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:  # noqa: ANN001 - autograd's signature
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        return grad * ctx.scale, None


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts: an expert-parallel weight is a DTensor sharded on dim 0."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


def grouped_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` can take ``x [M, K]`` against ``weight [G, N, K]`` here."""
    step = 16 // weight.element_size() if 16 % weight.element_size() == 0 else 0
    return (step > 0 and x.shape[0] > 0 and weight.shape[-1] % step == 0 and weight.shape[-2] % step == 0
            and compat.grouped_mm_supported(weight.device, weight.dtype))


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor,
                   use_grouped_mm: bool = True) -> torch.Tensor:
    """Rows of ``x [M, K]`` (``counts[g]`` per group, in order) times ``weight[g].T`` (``weight [G, N, K]``)."""
    if use_grouped_mm and grouped_mm_fits(x, weight):
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        out = compat.grouped_mm(x.contiguous(), weight.transpose(-2, -1), offsets)
        if out.requires_grad:
            # grouped_mm's backward refuses a stride-0 gradient (``y.sum().backward()``). A tensor hook
            # hands it a contiguous one and leaves ``out`` its own tensor: an identity autograd function
            # would return a view, on which FSDP cannot rely to hook the experts' backward (it warns).
            out.register_hook(_contiguous)
        return out
    return per_group_linear(x, weight, counts)


def per_group_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The exact loop: one matmul per group (reads the counts on the host).

    Empty groups still take part (a 0-row product), so every weight gets a gradient, zero
    where no token came: a rank whose experts got no token still has gradients to reduce.
    """
    pieces = torch.split(x, counts.tolist(), dim=0)
    # unbind, not weight[g]: the backward of E index ops would add E full-size zero gradients.
    return torch.cat([piece @ w.t() for piece, w in zip(pieces, weight.unbind(0), strict=True)])


class GroupedExperts(nn.Module):
    """``forward(x [M, D] grouped by expert, counts [E_local] int64) -> [M, D]`` in the parameter dtype.

    ``num_experts`` is the global count; under expert parallelism each weight is a DTensor
    sharded on dim 0 (``parallel.apply_expert_parallel``) and this rank computes its slice.
    ``use_grouped_mm=False`` forces the per-expert loop (the benchmark's baseline).
    ``grad_scale`` multiplies the weights' gradients: expert parallelism sets it to 1 / ep, tp / ep where
    it borrows TP's ranks (see ``parallel.apply_expert_parallel``). ``to_float8`` (the Float8 converter)
    switches the grouped products to FP8 where they run (``float8_experts.py``).
    """

    # The parameters stacked over the experts ([E, ...]): what expert parallelism shards on dim 0.
    stacked_names: tuple[str, ...] = ("w1", "w2", "w3")
    # Whether ``to_float8`` takes FP8 grouped GEMMs where they run (preflight reads it on the meta model).
    float8_capable: bool = True

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, use_grouped_mm: bool = True):
        super().__init__()
        self.dim, self.hidden_dim, self.num_experts = dim, hidden_dim, num_experts
        self.use_grouped_mm = use_grouped_mm
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.grad_scale = 1.0
        self.fp8 = False  # FP8 grouped GEMMs where they fit (to_float8)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        if self.grad_scale != 1.0:
            w1, w2, w3 = (_ScaleGrad.apply(w, self.grad_scale) for w in (w1, w2, w3))
        if counts.shape[0] != w1.shape[0]:
            raise ValueError(f"GroupedExperts: {counts.shape[0]} token counts for {w1.shape[0]} local experts")
        x = x.to(w1.dtype)
        gate = self.grouped(x, w1, counts)
        up = self.grouped(x, w3, counts)
        return self.grouped(F.silu(gate) * up, w2, counts)

    def to_float8(self, device_type: str, emulate: bool) -> bool:
        """The Float8 converter's switch: take FP8 grouped GEMMs where they run (CUDA, not emulated); whether
        they do. The parameters and the state dict stay as they are."""
        self.fp8 = fp8_grouped_mm_runs(device_type, emulate)
        return self.fp8

    def grouped(self, x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """One grouped product: FP8 where ``to_float8`` switched it on and the shapes fit, else high precision."""
        out = fp8_grouped_mm(x, weight, counts) if self.fp8 else None
        return out if out is not None else grouped_linear(x, weight, counts, self.use_grouped_mm)


class ClampedSwiGLUExperts(GroupedExperts):
    """GPT-OSS's experts: ``GroupedExperts`` with a bias on each projection and the clamped SwiGLU.

    Expert ``e`` computes ``w2[e] h + w2_bias[e]`` with ``h = (clamp(u, -limit, limit) + 1) * g *
    sigmoid(alpha * g)``, ``g = clamp(w1[e] x + w1_bias[e], max=limit)`` and ``u = w3[e] x + w3_bias[e]``.
    Each bias is stacked over the experts like the weights (expert parallelism shards it with them).
    """

    stacked_names = ("w1", "w2", "w3", "w1_bias", "w2_bias", "w3_bias")
    float8_capable = False  # see to_float8

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, limit: float, alpha: float,
                 use_grouped_mm: bool = True):
        super().__init__(dim, hidden_dim, num_experts, use_grouped_mm)
        self.limit, self.alpha = limit, alpha
        self.w1_bias = nn.Parameter(torch.empty(num_experts, hidden_dim))
        self.w2_bias = nn.Parameter(torch.empty(num_experts, dim))
        self.w3_bias = nn.Parameter(torch.empty(num_experts, hidden_dim))

    def to_float8(self, device_type: str, emulate: bool) -> bool:
        """Stays in high precision: its biased, clamped products have not been checked against FP8 on a GPU."""
        return False

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        weights = [_local(getattr(self, name)) for name in self.stacked_names]
        if self.grad_scale != 1.0:
            weights = [_ScaleGrad.apply(w, self.grad_scale) for w in weights]
        w1, w2, w3, b1, b2, b3 = weights
        if counts.shape[0] != w1.shape[0]:
            raise ValueError(f"ClampedSwiGLUExperts: {counts.shape[0]} token counts for {w1.shape[0]} local experts")
        x = x.to(w1.dtype)
        rows = x.shape[0]  # each row takes its expert's bias: the expert-major counts repeat them

        def biased(out: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
            return out + torch.repeat_interleave(bias, counts, dim=0, output_size=rows)

        gate = biased(self.grouped(x, w1, counts), b1).clamp(max=self.limit)
        up = biased(self.grouped(x, w3, counts), b3).clamp(-self.limit, self.limit)
        hidden = (up + 1) * gate * torch.sigmoid(self.alpha * gate)
        return biased(self.grouped(hidden, w2, counts), b2)
