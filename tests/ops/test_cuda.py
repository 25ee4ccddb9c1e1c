"""Checks that only a CUDA device can run (``pytest -m gpu``; skipped without CUDA, tests/tiers.py).

- the experts' grouped GEMM in bfloat16 (the GPU's dtype) against the exact per-expert loop, forward and
  the weights' gradients, with a bare-sum backward (the stride-0 gradient the experts' hook makes contiguous);
- the oneDNN linears never reach a CUDA tensor: ``training.cpu_matmul`` is a CPU switch.
"""

from __future__ import annotations

import pytest
import torch

from torchtitan.models.moe.experts import GroupedExperts, grouped_mm_fits
from torchtitan.ops.cpu_kernels import eager_cpu

pytestmark = pytest.mark.gpu


def test_grouped_gemm_in_bf16_on_cuda_matches_the_per_expert_loop():
    torch.manual_seed(0)
    grouped = GroupedExperts(64, 128, 4).cuda().to(torch.bfloat16)
    for w in (grouped.w1, grouped.w2, grouped.w3):
        torch.nn.init.normal_(w, std=0.05)
    loop = GroupedExperts(64, 128, 4, use_grouped_mm=False).cuda().to(torch.bfloat16)
    loop.load_state_dict(grouped.state_dict())
    counts = torch.tensor([5, 0, 17, 10], device="cuda")
    x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
    assert grouped_mm_fits(x, grouped.w1), "the aligned bf16 shapes take torch._grouped_mm on CUDA"
    outs = []
    for experts in (grouped, loop):
        y = experts(x, counts)
        y.sum().backward()  # a bare sum: a stride-0 gradient into grouped_mm's backward
        outs.append((y.float(), [w.grad.float() for w in (experts.w1, experts.w2, experts.w3)]))
        assert y._base is None, "FSDP hooks the experts' output: it must not be a view"
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=2e-2, atol=2e-2)
    for a, b in zip(outs[0][1], outs[1][1], strict=True):
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-2)


def test_cpu_kernels_refuse_cuda_tensors():
    assert not eager_cpu(torch.zeros(2, device="cuda"))
    assert eager_cpu(torch.zeros(2))
