"""The CUDA kernels that have no CPU path, checked on a GPU (the ``gpu`` tier: ``python -m pytest -m gpu``).

On CPU the suite checks the document mask through the per-document SDPA path and the dense
mask, and the experts through ``torch._grouped_mm``'s CPU kernel; on CUDA the model runs
FlexAttention and CUTLASS grouped GEMMs instead. These tests hold those kernels to the same
definitions: the mask_mod's dense mask (``dense_mask``) and the exact per-expert loop.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from conftest import DEBUG_CONFIG, REPO, torchrun_env

from torchtitan.models.attention import (
    block_causal_attention,
    build_document_mask,
    dense_mask,
    document_causal_mask_mod,
)
from torchtitan.models.moe.experts import GroupedExperts

pytestmark = pytest.mark.gpu


def _positions(seq: int, doc_lengths: list[int]) -> torch.Tensor:
    """Positions restarting at 0 at each document's first token (the last document fills the row)."""
    pos, total = [], 0
    for n in doc_lengths:
        pos.append(torch.arange(n))
        total += n
    pos.append(torch.arange(seq - total))
    return torch.cat(pos)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_flex_block_causal_equals_the_dense_mask_forward_and_backward(dtype: torch.dtype, tol: float) -> None:
    """FlexAttention under the project's BlockMask against SDPA with the mask_mod's dense mask (grouped-query)."""
    torch.manual_seed(0)
    batch, heads, kv_heads, seq, head_dim = 2, 8, 2, 512, 64
    positions = torch.stack([_positions(seq, [100, 37, 200]), _positions(seq, [5, 300])]).cuda()
    q = torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(batch, kv_heads, seq, head_dim, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(batch, kv_heads, seq, head_dim, device="cuda", dtype=dtype, requires_grad=True)
    grad = torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=dtype)

    out = block_causal_attention(q, k, v, build_document_mask(positions, batch))
    out.backward(grad)
    flex = (out.detach().float(), *(t.grad.float() for t in (q, k, v)))

    ref_inputs = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    mask = dense_mask(document_causal_mask_mod(positions.eq(0).cumsum(-1, dtype=torch.int32)), batch, seq, seq,
                      q.device)
    ref = torch.nn.functional.scaled_dot_product_attention(*ref_inputs, attn_mask=mask, enable_gqa=True)
    ref.backward(grad.float())
    for name, got, want in zip(("out", "dq", "dk", "dv"), flex, (ref.detach(), *(t.grad for t in ref_inputs))):
        rel = ((got - want).norm() / want.norm()).item()
        assert rel < tol, f"{name}: FlexAttention differs from the dense-mask reference by {rel:.2e} relative"


def test_grouped_gemm_equals_the_per_expert_loop_on_cuda() -> None:
    """The CUTLASS grouped GEMM (bf16, uneven routing, one idle expert) against the exact loop, both passes."""
    torch.manual_seed(0)
    dim, hidden, experts, rows = 256, 512, 8, 4096
    pair = {flag: GroupedExperts(dim, hidden, experts, use_grouped_mm=flag).cuda().to(torch.bfloat16)
            for flag in (True, False)}
    for name in ("w1", "w2", "w3"):
        value = torch.randn_like(getattr(pair[True], name)) * 0.05
        for module in pair.values():
            getattr(module, name).data.copy_(value)
    counts = torch.tensor([600, 0, 900, 300, 700, 500, 400, 696], device="cuda")
    assert int(counts.sum()) == rows
    x = torch.randn(rows, dim, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(rows, dim, device="cuda", dtype=torch.bfloat16)
    results = {}
    for flag, module in pair.items():
        xi = x.clone().requires_grad_(True)
        y = module(xi, counts)
        y.backward(grad)
        results[flag] = [y.detach().float(), xi.grad.float(), *(p.grad.float() for p in module.parameters())]
    for name, got, want in zip(("out", "dx", "dw1", "dw2", "dw3"), results[True], results[False]):
        rel = ((got - want).norm() / want.norm()).item()
        assert rel < 1e-2, f"{name}: grouped GEMM differs from the per-expert loop by {rel:.2e} relative"
    assert results[True][2][1].abs().sum() == 0, "the expert that got no token has a gradient"


@pytest.mark.slow
@pytest.mark.parametrize("mask", ["block_causal", "causal"])
def test_train_py_trains_the_debug_model_on_cuda(mask: str, tmp_path) -> None:
    """train.py in one process on the GPU, bf16 compute: exits 0 and the loss falls over 20 steps."""
    cmd = [sys.executable, "train.py", "--job.config_file", DEBUG_CONFIG, "--training.steps", "20",
           "--training.seq_len", "1024", "--training.batch_size", "4", "--metrics.log_freq", "1",
           "--metrics.enable_tensorboard", "false", "--model.attn_mask_type", mask,
           "--training.mixed_precision_param", "bfloat16", "--job.dump_folder", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=torchrun_env(), capture_output=True, text=True, timeout=600)
    out = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)
    assert proc.returncode == 0, out[-3000:]
    # MFU is reported only where the device's peak is known: a GPU, not the CPU fallback.
    assert re.search(r"mfu: [0-9.]+%", out), "the run reported no MFU: it did not train on the GPU"
    losses = [float(x) for x in re.findall(r"(?<!validation )step: *\d+ +loss: *([0-9.]+)", out)]
    assert len(losses) >= 10, out[-3000:]
    assert losses[-1] < losses[0] - 0.5, f"the loss did not fall: {losses[0]} -> {losses[-1]}"
