"""``training.cpu_matmul = "auto"``: oneDNN on the CPUs where MKL keeps to AVX2 (AMD, Hygon with AVX-512),
ATen elsewhere; the explicit choices are kept."""

from __future__ import annotations

import pytest

from torchtitan.config import ConfigManager
from torchtitan.ops.cpu_matmul import preferred_cpu_matmul, resolve_cpu_matmul


def _cpuinfo(vendor: str, flags: str) -> str:
    return (f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: 25\nmodel name\t: some CPU\n"
            f"flags\t\t: fpu sse sse2 avx avx2 fma {flags}\n\nprocessor\t: 1\nvendor_id\t: {vendor}\n")


@pytest.mark.parametrize("vendor, flags, want", [
    ("AuthenticAMD", "avx512f avx512bw avx512vl", "onednn"),  # benchmarks section 11's EPYC: MKL keeps to AVX2
    ("HygonGenuine", "avx512f", "onednn"),
    ("AuthenticAMD", "", "aten"),  # no AVX-512: oneDNN has nothing wider to run
    ("GenuineIntel", "avx512f avx512bw avx512vl", "aten"),  # MKL runs AVX-512 itself, and is faster
    ("GenuineIntel", "", "aten"),
])
def test_auto_follows_the_vendor_and_the_instruction_set(vendor, flags, want):
    assert preferred_cpu_matmul(_cpuinfo(vendor, flags)) == want
    assert resolve_cpu_matmul("auto", _cpuinfo(vendor, flags)) == want


def test_non_x86_or_unreadable_cpuinfo_keeps_torchs_default():
    arm = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes sve\nCPU implementer\t: 0x41\n"
    assert preferred_cpu_matmul(arm) == "aten"
    assert preferred_cpu_matmul("") == "aten"


@pytest.mark.parametrize("option", ["onednn", "aten"])
def test_an_explicit_choice_is_kept_on_any_cpu(option):
    for vendor in ("AuthenticAMD", "GenuineIntel"):
        assert resolve_cpu_matmul(option, _cpuinfo(vendor, "avx512f")) == option


def test_the_default_is_auto():
    assert ConfigManager().parse_args([]).training.cpu_matmul == "auto"
