"""Accelerator facts used for MFU and memory reporting."""

import re
import resource
import sys
from dataclasses import dataclass

import torch

_GIB = 1024**3


@dataclass(frozen=True)
class _PeakEntry:
    # Regex searched (case-insensitively) in torch.cuda.get_device_name().
    pattern: str
    # Dense (no structured sparsity) tensor-core FLOP/s with bf16/fp16 inputs.
    bf16: float
    # Dense TF32 tensor-core FLOP/s: what fp32 matmuls reach when TF32 is
    # allowed (torch.backends.cuda.matmul.allow_tf32 / "high" precision).
    # For AMD this is the XF32/TF32 matrix rate. None when not published.
    tf32: float | None


# Order matters: the first match wins, so more specific names (H100 NVL,
# H100 PCIe, GH200, H200 NVL) come before the plain family name. Word
# boundaries keep "H20" from matching "H200" and "L4" from matching "L40S".
# Figures are vendor datasheet numbers halved wherever the datasheet quotes
# them "with sparsity".
_PEAK_TABLE: tuple[_PeakEntry, ...] = (
    # Blackwell
    _PeakEntry(r"\bGB200\b", bf16=2.5e15, tf32=1.25e15),
    _PeakEntry(r"\bB200\b", bf16=2.25e15, tf32=1.1e15),
    # Hopper
    _PeakEntry(r"\bGH200\b", bf16=989.4e12, tf32=494.7e12),
    _PeakEntry(r"\bH200\b.*\bNVL\b", bf16=835.5e12, tf32=417.5e12),
    _PeakEntry(r"\bH200\b", bf16=989.4e12, tf32=494.7e12),
    _PeakEntry(r"\bH100\b.*\bNVL\b", bf16=835.5e12, tf32=417.5e12),
    _PeakEntry(r"\bH100\b.*\bPCIe\b", bf16=756e12, tf32=378e12),
    _PeakEntry(r"\bH100\b", bf16=989.4e12, tf32=494.7e12),  # SXM / HBM3
    _PeakEntry(r"\bH800\b.*\bPCIe\b", bf16=756e12, tf32=378e12),
    _PeakEntry(r"\bH800\b", bf16=989.4e12, tf32=494.7e12),
    _PeakEntry(r"\bH20\b", bf16=148e12, tf32=74e12),
    # Ada
    _PeakEntry(r"\bL40S\b", bf16=362.05e12, tf32=183e12),
    _PeakEntry(r"\bL40\b", bf16=181.05e12, tf32=90.5e12),
    _PeakEntry(r"\bL4\b", bf16=121e12, tf32=60e12),
    # GeForce parts run bf16 (fp32 accumulate) at half the fp16-accumulate rate.
    _PeakEntry(r"\bRTX 4090\b", bf16=165.2e12, tf32=82.6e12),
    # Ampere
    _PeakEntry(r"\bA100\b", bf16=312e12, tf32=156e12),
    _PeakEntry(r"\bA800\b", bf16=312e12, tf32=156e12),
    # A10G (AWS) is usually quoted with the A10 datasheet figures.
    _PeakEntry(r"\bA10G?\b", bf16=125e12, tf32=62.5e12),
    # AMD Instinct
    _PeakEntry(r"\bMI325X\b", bf16=1307.4e12, tf32=653.7e12),
    _PeakEntry(r"\bMI300X\b", bf16=1307.4e12, tf32=653.7e12),
    _PeakEntry(r"\bMI250X\b", bf16=383e12, tf32=None),
)


def peak_flops(device_name: str, dtype: torch.dtype = torch.bfloat16) -> float | None:
    """Dense peak FLOP/s of one device for matmuls in ``dtype``.

    ``device_name`` is a ``torch.cuda.get_device_name()`` string. Returns None
    for unknown devices (and CPUs), or dtypes without a table entry, so that
    callers simply skip MFU instead of reporting a made-up number.
    float32 maps to the TF32 tensor-core rate (see ``_PeakEntry.tf32``).
    """
    for entry in _PEAK_TABLE:
        if re.search(entry.pattern, device_name, flags=re.IGNORECASE):
            if dtype in (torch.bfloat16, torch.float16):
                return entry.bf16
            if dtype == torch.float32:
                return entry.tf32
            return None
    return None


def _cuda_memory(device: torch.device) -> dict[str, float]:
    stats = torch.cuda.memory_stats(device)
    capacity = torch.cuda.get_device_properties(device).total_memory
    max_active = stats.get("active_bytes.all.peak", 0)
    max_reserved = stats.get("reserved_bytes.all.peak", 0)
    return {
        "max_active_gib": max_active / _GIB,
        "max_active_pct": 100.0 * max_active / capacity,
        "max_reserved_gib": max_reserved / _GIB,
        "max_reserved_pct": 100.0 * max_reserved / capacity,
        # Retries mean the caching allocator had to free cached blocks and try
        # again: a sign of fragmentation or being right at the memory limit.
        "num_alloc_retries": float(stats.get("num_alloc_retries", 0)),
        "num_ooms": float(stats.get("num_ooms", 0)),
    }


def _proc_status_kib(field: str) -> int | None:
    """A ``kB`` field of /proc/self/status (Linux only), or None."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _host_memory() -> dict[str, float]:
    rss_kib = _proc_status_kib("VmRSS")
    peak_kib = _proc_status_kib("VmHWM")
    if rss_kib is None or peak_kib is None:
        # getrusage only knows the peak; it stands in for the current RSS too.
        max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        # ru_maxrss is in bytes on macOS and in KiB elsewhere.
        max_rss_kib = max_rss / 1024 if sys.platform == "darwin" else max_rss
        rss_kib = rss_kib if rss_kib is not None else max_rss_kib
        peak_kib = peak_kib if peak_kib is not None else max_rss_kib
    return {
        "rss_gib": rss_kib * 1024 / _GIB,
        "peak_rss_gib": peak_kib * 1024 / _GIB,
    }


def device_memory(device: torch.device) -> dict[str, float]:
    """Memory use since the last ``reset_peak_memory``.

    CUDA (and ROCm, which shows up as "cuda") reports allocator peaks; every
    other device reports the host process RSS, which is where CPU tensors live.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return _cuda_memory(device)
    return _host_memory()


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-measurement window (e.g. after each log step)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    # Writing "5" to clear_refs resets VmHWM on Linux; elsewhere (or when the
    # kernel refuses) the peak just stays cumulative, which is harmless.
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        pass
