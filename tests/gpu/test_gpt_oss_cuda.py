"""GPT-OSS's CUDA attention kernel (FlexAttention with the sink through its log-sum-exp) against the dense sink
kernel the CPU runs and transformers' logits are checked with (``python -m pytest -m gpu``)."""

from __future__ import annotations

import pytest
import torch

from torchtitan.models.attention import build_document_mask
from torchtitan.models.attention.kernels import flex_sink_attention, sink_attention
from torchtitan.models.attention.masks import layer_block_mask, layer_mask

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("window", [None, 64])
@pytest.mark.parametrize("documents", [False, True])
def test_flex_sink_attention_equals_the_dense_kernel_forward_and_backward(window, documents) -> None:
    torch.manual_seed(0)
    batch, heads, kv_heads, seq, head_dim = 2, 8, 2, 512, 64
    positions = torch.cat([torch.arange(100), torch.arange(300), torch.arange(112)]).cuda()[None].expand(batch, -1)
    mask = build_document_mask(positions, batch) if documents else None
    q = torch.randn(batch, heads, seq, head_dim, device="cuda", requires_grad=True)
    k = torch.randn(batch, kv_heads, seq, head_dim, device="cuda", requires_grad=True)
    v = torch.randn(batch, kv_heads, seq, head_dim, device="cuda", requires_grad=True)
    sinks = (2 * torch.randn(heads, device="cuda")).requires_grad_(True)
    grad = torch.randn(batch, heads, seq, head_dim, device="cuda")
    leaves = (q, k, v, sinks)

    out = flex_sink_attention(q, k, v, layer_block_mask(mask, window, batch, seq, q.device), sinks)
    got = (out.detach(), *torch.autograd.grad(out, leaves, grad))
    ref = sink_attention(q, k, v, layer_mask(mask, window, batch, 0, seq, seq, q.device), sinks)
    want = (ref.detach(), *torch.autograd.grad(ref, leaves, grad))
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
        rel = ((a - b).norm() / b.norm()).item()
        assert rel < 2e-5, f"{name}: FlexAttention with the sink differs from the dense kernel by {rel:.2e} relative"


def test_gpt_oss_debug_model_trains_a_step_on_cuda() -> None:
    from torchtitan.models import get_model_spec

    spec = get_model_spec("gpt_oss")
    torch.manual_seed(0)
    model = spec.build(spec.flavors["debugmodel"]).cuda()
    model.init_weights()
    tokens = torch.randint(0, 2048, (2, 256), device="cuda")
    positions = torch.cat([torch.arange(100), torch.arange(156)]).cuda()[None].expand(2, -1)
    logits = model(tokens, positions)
    with torch.device("cpu"):
        cpu = spec.build(spec.flavors["debugmodel"])
    cpu.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
    want = cpu(tokens.cpu(), positions.cpu())
    rel = ((logits.cpu() - want).norm() / want.norm()).item()
    assert rel < 1e-4, rel
    logits.float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())
