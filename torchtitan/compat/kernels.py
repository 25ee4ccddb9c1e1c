"""Kernels whose availability differs by release and device: ``torch._grouped_mm`` (mixture of experts), the
lower-right causal bias without its storage (CP attention), and the fused optimizer kernels' devices."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator

import torch

from torchtitan.compat.errors import missing


def lower_right_causal_bias(seq_len_q: int, seq_len_kv: int) -> torch.Tensor:
    """``causal_lower_right(seq_len_q, seq_len_kv)`` without its storage.

    The public factory calls ``CausalBias(variant, seq_len_q, seq_len_kv)``, and the Tensor
    constructor reads those three ints as a shape: each bias then holds an unused float32 storage
    of ``2 * seq_len_q * seq_len_kv`` elements (8 GiB for a 16k-token CP chunk against 256k keys;
    seen on 2.13 and 2.14). Long-context CP builds one per chunk, so a strict-overcommit host
    refuses it. The bias made here sits on an empty storage; SDPA's handling of it reads only the
    variant and the two lengths.
    """
    from torch.nn.attention.bias import CausalBias, CausalVariant

    bias = torch.Tensor._make_subclass(CausalBias, torch.empty(0, dtype=torch.bool))
    CausalBias.__init__(bias, CausalVariant.LOWER_RIGHT, seq_len_q, seq_len_kv)
    return bias


def grouped_mm(x: torch.Tensor, weight_t: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm``: rows ``offsets[g-1]:offsets[g]`` of ``x [M, K]`` times ``weight_t[g] [K, N]``.

    ``offsets`` is the int32 running sum of the group sizes. Callers check
    ``grouped_mm_supported`` first and keep an exact per-group loop for the rest.
    """
    if not hasattr(torch, "_grouped_mm"):
        raise missing("torch._grouped_mm")
    return torch._grouped_mm(x, weight_t, offs=offsets)  # pyright: ignore[reportPrivateImportUsage]  (private op)


_GROUPED_MM_PROBED: dict[tuple[str, torch.dtype], bool] = {}


_GROUPED_MM_AS_ON: list[frozenset[torch.dtype]] = []  # innermost last: dtypes assumed to take grouped_mm


@contextlib.contextmanager
def grouped_mm_as_on(dtypes: frozenset[torch.dtype]) -> Iterator[None]:
    """Inside, ``grouped_mm_supported`` answers as a device whose kernel takes exactly ``dtypes``, whatever the
    tensors' device: the planner's dry run prices a GPU (CUDA's kernel: bf16) on fake CPU tensors, and the
    fake kernel takes bf16 only, so the CPU probe's answer would be both wrong and fatal there."""
    _GROUPED_MM_AS_ON.append(frozenset(dtypes))
    try:
        yield
    finally:
        _GROUPED_MM_AS_ON.pop()


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs here, forward and backward (probed once per device type and dtype).

    The op is present from torch 2.8 but had no CPU kernel until 2.9 and takes only some dtypes
    per device (CUDA: bf16 on sm80+), so a small call is the only reliable test; a failure means
    the caller's per-expert loop, never an error. Inside ``grouped_mm_as_on`` its dtypes answer.
    """
    if _GROUPED_MM_AS_ON:
        return dtype in _GROUPED_MM_AS_ON[-1]
    key = (torch.device(device).type, dtype)
    if key not in _GROUPED_MM_PROBED:
        # Probed on real tensors even inside a fake-tensor trace (the planner), whose answer would stick.
        try:
            from torch._subclasses.fake_tensor import unset_fake_temporarily
        except ImportError as e:
            raise missing("torch._subclasses.fake_tensor.unset_fake_temporarily") from e
        # Own saved-tensor hooks (identity): a first call inside an activation-checkpointed forward
        # must not save the probe's tensors to the checkpoint, whose recompute (probe cached) would not.
        with unset_fake_temporarily(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            _GROUPED_MM_PROBED[key] = _probe_grouped_mm(torch.device(device), dtype)
    return _GROUPED_MM_PROBED[key]


def _probe_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        with torch.enable_grad():
            x = torch.ones(6, 8, device=device, dtype=dtype, requires_grad=True)
            w = torch.ones(2, 8, 8, device=device, dtype=dtype, requires_grad=True)
            offsets = torch.tensor([2, 6], device=device, dtype=torch.int32)
            out = grouped_mm(x, w.transpose(-2, -1), offsets)
            out.backward(torch.ones_like(out))
        return bool(torch.all(out == 8)) and x.grad is not None and w.grad is not None
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def fused_kernel_devices() -> tuple[str, ...]:
    """The device types torch has fused optimizer kernels for (at least CUDA, where the helper is gone)."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:
        return ("cuda",)  # every version has the CUDA kernels; only the list of the others is private
    return tuple(_get_fused_kernels_supported_devices())


_SCALED_MM_PROBED: dict[str, bool] = {}


def scaled_mm_supported(device_type: str) -> bool:
    """Whether ``torch._scaled_mm`` multiplies float8 tensors on ``device_type`` (probed once per type).

    torch 2.13's CPU build has the kernel; older CPU builds may not, and then Float8 runs emulated
    there. On CUDA the kernel exists and the GPU's generation decides (``cuda_capability``).
    """
    if device_type != "cpu":
        return hasattr(torch, "_scaled_mm")
    if device_type not in _SCALED_MM_PROBED:
        try:
            a = torch.ones(16, 16).to(torch.float8_e4m3fn)
            one = torch.ones((), dtype=torch.float32)
            scaled_mm = getattr(torch, "_scaled_mm")  # noqa: B009 - private in torch's stubs (pyright)
            scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
            _SCALED_MM_PROBED[device_type] = True
        except (RuntimeError, NotImplementedError, AttributeError, TypeError):
            _SCALED_MM_PROBED[device_type] = False
    return _SCALED_MM_PROBED[device_type]


def scaled_grouped_mm_available() -> bool:
    """Whether this torch has ``torch._scaled_grouped_mm`` (the FP8 grouped GEMM, CUDA only)."""
    return hasattr(torch, "_scaled_grouped_mm")


# Where torchao keeps the FP8 grouped GEMM that routed experts take (models/moe/float8_experts.py).
TORCHAO_GROUPED_MM = "torchao.prototype.moe_training.fp8_grouped_mm"


def fp8_grouped_mm_missing() -> str | None:
    """Why this torch and torchao cannot compute FP8 grouped GEMMs (on any GPU), or None."""
    if not scaled_grouped_mm_available():
        return f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    try:
        module = importlib.import_module(TORCHAO_GROUPED_MM)
    except ImportError:
        module = None
    if not hasattr(module, "_to_fp8_rowwise_then_scaled_grouped_mm"):
        return f"the installed torchao has no {TORCHAO_GROUPED_MM}._to_fp8_rowwise_then_scaled_grouped_mm"
    return None


def fp8_grouped_mm_skip_reason(device_type: str, emulate: bool) -> str | None:
    """Why routed experts stay in high precision here, or None where they take FP8 grouped GEMMs (the GPU
    generation is preflight's check)."""
    if device_type != "cuda":
        return f"no CUDA device (this run is on {device_type})"
    if emulate:
        return "--float8.emulate (no FP8 kernel is asked for)"
    return fp8_grouped_mm_missing()


def cuda_capability() -> tuple[int, int] | None:
    """The first visible GPU's compute capability (major, minor); None without a CUDA device."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(0)
