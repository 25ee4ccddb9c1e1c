"""Float8 on CUDA (the ``gpu`` tier): the paths with no CPU counterpart.

On CPU the suite checks the Float8 linears (torch 2.13's CPU ``_scaled_mm``) and the experts' padding
with a high-precision product; here the FP8 grouped GEMM itself (``torch._scaled_grouped_mm`` through
torchao, SM 8.9+) is held to the bf16 per-expert product, and a Float8 MoE model trains through train.py.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from conftest import REPO, torchrun_env

from torchtitan import compat
from torchtitan.models.moe.experts import GroupedExperts

pytestmark = pytest.mark.gpu


def _fp8_gpu() -> bool:
    capability = compat.cuda_capability()
    return capability is not None and capability >= (8, 9) and compat.scaled_grouped_mm_available()


def test_fp8_grouped_experts_track_the_bf16_product_forward_and_backward() -> None:
    """Uneven routing (an idle expert, groups not multiples of 16): FP8 within FP8's error of bf16, both passes."""
    if not _fp8_gpu():
        pytest.fail(f"this GPU (capability {compat.cuda_capability()}) has no FP8 grouped GEMM; the tier needs SM 8.9+")
    torch.manual_seed(0)
    dim, hidden, experts = 256, 512, 8
    counts = torch.tensor([600, 0, 901, 300, 699, 500, 403, 693], device="cuda")
    pair = [GroupedExperts(dim, hidden, experts).cuda().to(torch.bfloat16) for _ in range(2)]
    for name in ("w1", "w2", "w3"):
        value = torch.randn_like(getattr(pair[0], name)) * 0.05
        for module in pair:
            getattr(module, name).data.copy_(value)
    pair[1].fp8 = True  # what to_float8 switches on where FP8 grouped GEMMs run
    x = torch.randn(int(counts.sum()), dim, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    results = []
    for module in pair:
        xi = x.clone().requires_grad_(True)
        y = module(xi, counts)
        y.backward(grad)
        results.append([y.detach().float(), xi.grad.float(), *(p.grad.float() for p in module.parameters())])
    for name, got, want in zip(("out", "dx", "dw1", "dw2", "dw3"), results[1], results[0]):
        rel = ((got - want).norm() / want.norm()).item()
        # FP8 e4m3 keeps 3 mantissa bits: a product's relative error is a few percent, not more.
        assert 1e-4 < rel < 0.1, f"{name}: FP8 grouped GEMM is {rel:.2e} relative from bf16"
    assert results[1][3].abs().sum() == 0, "the expert that got no token has a gradient"


@pytest.mark.slow
def test_train_py_trains_a_float8_moe_model_on_cuda(tmp_path) -> None:
    """The debug MoE model in Float8 on the GPU: FP8 linears and FP8 grouped GEMMs; the loss falls."""
    cmd = [sys.executable, "train.py", "--job.config_file", str(REPO / "train_configs" / "qwen3_debug_moe.toml"),
           "--model.converters", "float8", "--training.steps", "20", "--training.seq_len", "1024",
           "--training.batch_size", "4", "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
           "--job.dump_folder", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=torchrun_env(), capture_output=True, text=True, timeout=600)
    out = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)
    assert proc.returncode == 0, out[-3000:]
    assert re.search(r"Float8 \(tensorwise\): \d+ of \d+ linear layers converted", out), out[-3000:]
    assert "run FP8 grouped GEMMs" in out, out[-3000:]
    losses = [float(x) for x in re.findall(r"(?<!validation )step: *\d+ +loss: *([0-9.]+)", out)]
    assert len(losses) >= 10 and losses[-1] < losses[0] - 0.5, losses
