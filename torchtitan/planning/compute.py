"""The work of a dry-run step, op by op, at each rank's local shapes: matmul and attention FLOPs, and the
bytes that the other (memory-bound) kernels read and write.

The cost model (``cost.py``) turns these into time on a device: matmuls at the device's achievable
matmul rate, attention at its attention kernel's rate, the rest at its memory bandwidth, plus a
launch cost per kernel. Nothing here depends on a cluster.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from torchtitan.compat import op_name, op_schema, tree_flatten
from torchtitan.planning.memory import local_tensor

aten = torch.ops.aten
_MATMULS = {aten.mm.default: "mm", aten.addmm.default: "addmm", aten.bmm.default: "bmm"}
if hasattr(aten, "_grouped_mm"):  # the experts' grouped GEMM (torch >= 2.8); its backward is two more of it
    _MATMULS[aten._grouped_mm.default] = "grouped_mm"
# Float8 products (torchao's Float8 linears, and the experts' FP8 grouped GEMM on CUDA): priced at the FP8 peak.
# Their operands' casts (amax, scale, convert) are memory-bound kernels, priced by their bytes like the rest.
_FP8_MATMULS = {aten._scaled_mm.default: "mm"} if hasattr(aten, "_scaled_mm") else {}
if hasattr(aten, "_scaled_grouped_mm"):
    _FP8_MATMULS[aten._scaled_grouped_mm.default] = "grouped_mm"
# Ops that move no data (views, metadata, bookkeeping): no kernel on a GPU.
_FREE = {"view", "_unsafe_view", "t", "transpose", "detach", "as_strided", "alias", "expand", "unsqueeze",
         "squeeze", "permute", "split", "split_with_sizes", "slice", "select", "unbind", "view_as_real",
         "view_as_complex", "_conj", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
         "chunk", "unflatten", "flatten", "lift_fresh", "_reshape_alias", "resolve_conj", "resolve_neg",
         "_record_function_enter_new", "_record_function_exit", "device", "set_", "_has_compatible_shallow_copy_type",
         "record_stream",
         # A functional collective's wait: it moves nothing (the collective's own buffers are priced once, at
         # the collective, as the memory traffic its kernel adds beside its communication time).
         "wait_tensor"}


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(local_tensor(t).shape)


def _tensors(tree) -> list[torch.Tensor]:
    return [local_tensor(t) for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def matmul_flops(func, args) -> int:
    kind = _MATMULS[func] if func in _MATMULS else _FP8_MATMULS[func]
    if kind == "addmm":
        args = args[1:]
    a, b = _shape(args[0]), _shape(args[1])
    if kind == "bmm":
        return 2 * a[0] * a[1] * a[2] * b[2]
    if kind == "grouped_mm":
        return grouped_mm_flops(a, b)
    return 2 * a[0] * a[1] * b[1]


def grouped_mm_flops(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """FLOPs of ``torch._grouped_mm(a, b, offs)``: the groups split one dim, so the total is one GEMM's.

    2-D x 3-D (the experts' forward and input gradient): ``[M, K] x [G, K, N]``, rows split: 2 M K N;
    2-D x 2-D (the weight gradient): ``[N, M] x [M, K] -> [G, N, K]``, the M split: 2 N M K;
    3-D x 2-D: ``[G, M, K] x [K, N]``, columns split: 2 M K N; 3-D x 3-D: a batched GEMM.
    """
    if len(a) == 2:
        return 2 * a[0] * a[1] * b[-1]
    if len(b) == 2:
        return 2 * a[1] * a[2] * b[1]
    return 2 * a[0] * a[1] * a[2] * b[2]


# The planner's stand-ins for fused attention kernels the CPU lacks, by op name: fused_attention.py (torch's
# SDPA names), sink_attention.py (FlexAttention, with its sliding window as an argument).
_FLEX_ATTENTION = ("flex_attention", "flex_attention_backward")


def is_attention(name: str) -> bool:
    return "scaled_dot_product" in name or name in _FLEX_ATTENTION


def causal_pairs(seq: int, window: int) -> int:
    """The (query, key) pairs a causal sliding window of ``window`` keys (the query's own included) leaves in a
    sequence of ``seq``: row i keeps min(i + 1, window) keys."""
    w = min(window, seq)
    return w * seq - w * (w - 1) // 2


def _window(func, args) -> int:
    """A planner attention op's sliding window (0: none; torch's own ops have none)."""
    for i, arg in enumerate(op_schema(func).arguments):
        if arg.name == "window" and i < len(args):
            return int(args[i])
    return 0


def attention_flops(func, args) -> tuple[int, bool]:
    """FLOPs of a scaled-dot-product attention op (forward or backward), and whether it is causal.

    Counted over the whole score matrix, as ``flops_per_token`` counts it; a causal kernel skips
    about half of it, which the cost model applies. The two products are counted at their own head sizes:
    scores at the query's, the weighted sum at the value's (MLA's differ: ``fused_attention.py``).
    A sliding window's (``sink_attention.py``) are counted over the pairs it keeps, about L x W, whose kernel
    skips the blocks outside it: reported as not causal, so the cost model does not halve them again.
    """
    backward = "backward" in op_name(func)
    q, k, v = (args[1], args[2], args[3]) if backward else (args[0], args[1], args[2])
    b, h, s_q, d = _shape(q)
    s_k, d_v = _shape(k)[2], _shape(v)[-1]
    window = _window(func, args)
    pairs = causal_pairs(s_q, window) if window else s_q * s_k
    forward = 2 * b * h * pairs * (d + d_v)
    causal = not window and any(a is True for a in args[3:])
    return (2 * forward if backward else forward), causal


def moved_bytes(func, args, kwargs, out) -> int:
    """The bytes a memory-bound kernel reads and writes, each tensor once each way.

    Read: every tensor argument but an ``out=`` buffer (keyword-only), which is only written. Written: what
    the op returns, its ``out=`` buffers, and the arguments it updates in place without returning them: the
    foreach ops and the fused optimizers return nothing, and their updates are nearly half of an AdamW
    step's bytes. Fused Adam(W)'s schema marks the gradients as written because it unscales them in place
    when given a ``grad_scale``; without one it only reads them.
    """
    if func is torch.ops.aten.index_add_.default:
        # A GPU's kernel reads the source and the index and updates only the indexed rows, not all of ``self``.
        this, index, source = args[0], args[2], args[3]
        return index.numel() * index.element_size() + source.numel() * (source.element_size() + 2 * this.element_size())
    if func is torch.ops.aten.index_select.default:
        # ... and a gather reads only the rows it selects.
        return args[2].numel() * args[2].element_size() + 2 * out.numel() * out.element_size()
    read: dict[int, torch.Tensor] = {}
    written = {id(t): t for t in _tensors(out)}
    for i, arg in enumerate(op_schema(func).arguments):
        tensors = _tensors(args[i] if i < len(args) else kwargs.get(arg.name))
        writes = arg.alias_info is not None and arg.alias_info.is_write
        if arg.name == "grads" and kwargs.get("grad_scale") is None:
            writes = False
        if not (writes and arg.kwarg_only):
            read.update((id(t), t) for t in tensors)
        if writes:
            written.update((id(t), t) for t in tensors)
    return sum(t.numel() * t.element_size() for t in [*read.values(), *written.values()])


_FLOAT8_DTYPES = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz") if hasattr(torch, n)}


def _float8_operands(args) -> bool:
    """Whether a matmul's operands are float8: torchao's Float8 training tensors (which a dispatch mode sees
    before they run ``_scaled_mm``) or float8 data."""
    operands = [local_tensor(a) for a in args[:3] if isinstance(a, torch.Tensor)]
    return any(type(t).__name__ == "Float8TrainingTensor" or t.dtype in _FLOAT8_DTYPES for t in operands)


@dataclass
class PhaseWork:
    matmul_flops: int = 0
    fp8_matmul_flops: int = 0  # of them, the FP8 products (Float8 training)
    attention_flops: int = 0
    causal_attention_flops: int = 0
    memory_bytes: int = 0  # read + written by the memory-bound kernels
    kernels: int = 0

    def add(self, other: PhaseWork) -> None:
        for f in self.__dataclass_fields__:
            setattr(self, f, getattr(self, f) + getattr(other, f))

    def as_tuple(self) -> tuple[int, ...]:
        return tuple(getattr(self, f) for f in self.__dataclass_fields__)




def op_work(func, args, kwargs, out) -> PhaseWork | None:
    """One op's work (None: an op that launches no kernel)."""
    name = op_name(func)
    if name in _FREE:
        return None
    w = PhaseWork(kernels=1)
    if func in _MATMULS and not _float8_operands(args):
        w.matmul_flops = matmul_flops(func, args)
    elif func in _FP8_MATMULS or func in _MATMULS:
        w.matmul_flops = w.fp8_matmul_flops = matmul_flops(func, args)
    elif is_attention(name):
        w.attention_flops, causal = attention_flops(func, args)
        w.causal_attention_flops = w.attention_flops if causal else 0
    else:
        w.memory_bytes = moved_bytes(func, args, kwargs, out)
    return w


@dataclass
class ComputeLedger:
    """Work by phase (forward / backward / optimizer), summed over the recorded steps.

    ``covers``: the work since each in-flight collective was issued (``StepRecorder`` opens one at an
    asynchronous all-to-all's issue and closes it at the wait on its output): what runs while it travels.
    """

    phase: str = "build"
    recording: bool = False
    work: dict[str, PhaseWork] = field(default_factory=lambda: defaultdict(PhaseWork))
    covers: dict[int, PhaseWork] = field(default_factory=dict)  # in-flight output's storage id -> work since issue

    def on_op(self, func, args, kwargs, out) -> None:
        if not self.recording:
            return
        w = op_work(func, args, kwargs, out)
        if w is None:
            return
        self.work[self.phase].add(w)
        for cover in self.covers.values():
            cover.add(w)

    def totals(self) -> PhaseWork:
        total = PhaseWork()
        for w in self.work.values():
            for f in total.__dataclass_fields__:
                setattr(total, f, getattr(total, f) + getattr(w, f))
        return total
