"""Which kernel runs the float32 linear layers on this CPU: ``training.cpu_matmul = "auto"`` resolved.

ATen's float32 products run on MKL on x86. MKL picks its code by CPU *vendor*: on Intel CPUs with
AVX-512 it runs AVX-512 kernels, on AMD CPUs it keeps to AVX2 even where the CPU has AVX-512.
oneDNN picks by *instruction set*, so on an AMD CPU with AVX-512 it runs about twice as fast as
MKL, and on an Intel AVX-512 CPU it is a little slower than MKL (benchmarks/README.md section 11 has
a row per vendor). So ``auto`` is ``onednn`` on a non-Intel x86 CPU with AVX-512 (AMD, Hygon) and
``aten`` everywhere else (Intel, x86 without AVX-512, ARM, unknown). The choice reads
``/proc/cpuinfo`` (Linux); where it cannot, it is ``aten``, torch's default.
"""

from __future__ import annotations

from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
# x86 vendors whose CPUs MKL serves with AVX2 code even when they have AVX-512.
_AVX2_ONLY_UNDER_MKL = ("AuthenticAMD", "HygonGenuine")


def _field(cpuinfo: str, name: str) -> str:
    """The first ``name : value`` of a /proc/cpuinfo text ("" when absent)."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == name:
            return value.strip()
    return ""


def preferred_cpu_matmul(cpuinfo: str | None = None) -> str:
    """``onednn`` or ``aten`` for the CPU ``cpuinfo`` describes (None: this machine's /proc/cpuinfo)."""
    if cpuinfo is None:
        try:
            cpuinfo = CPUINFO.read_text()
        except OSError:
            return "aten"
    vendor = _field(cpuinfo, "vendor_id")
    flags = set(_field(cpuinfo, "flags").split())
    return "onednn" if vendor in _AVX2_ONLY_UNDER_MKL and "avx512f" in flags else "aten"


def resolve_cpu_matmul(option: str, cpuinfo: str | None = None) -> str:
    """The kernel ``training.cpu_matmul = option`` means here: ``auto`` chooses by CPU, the others are kept."""
    return preferred_cpu_matmul(cpuinfo) if option == "auto" else option
