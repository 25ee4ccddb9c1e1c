"""Context-parallel attention equals full causal attention, forward and backward (real gloo ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist_harness import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.attention.bias import causal_lower_right

from torchtitan.distributed.context_parallel import (
    _causal_mask,
    cp_attention,
    local_positions,
    shard_sequence,
)
from torchtitan.models.layers import repeat_kv

B, H, H_KV, L, D = 2, 4, 2, 32, 8


def _attention_matches(rank: int, world_size: int, compiled: bool) -> dict:
    torch.manual_seed(0)  # every rank draws the same full tensors
    q = torch.randn(B, H, L, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, H_KV, L, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, H_KV, L, D, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(B, H, L, D, dtype=torch.float64)
    ref = F.scaled_dot_product_attention(q, repeat_kv(k, H // H_KV), repeat_kv(v, H // H_KV), is_causal=True)
    ref.backward(grad_out)

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    local = [shard_sequence(t.detach(), rank, world_size, dim=2).requires_grad_() for t in (q, k, v)]
    fn = torch.compile(cp_attention, fullgraph=True) if compiled else cp_attention
    out = fn(*local, mesh=mesh)
    out.backward(shard_sequence(grad_out, rank, world_size, dim=2))

    def err(a: torch.Tensor, full: torch.Tensor) -> float:
        return float((a - shard_sequence(full, rank, world_size, dim=2)).abs().max())

    return {
        "out": err(out.detach(), ref.detach()),
        "grads": [err(t.grad, full.grad) for t, full in zip(local, (q, k, v))],
        "positions": local_positions(L, rank, world_size).tolist(),
    }


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_attention_equals_full_attention(cp):
    results = run_ranks(_attention_matches, cp, False)
    for r in results:
        assert r["out"] < 1e-12
        assert max(r["grads"]) < 1e-12, r["grads"]
    # Load balancing: rank r holds chunks r and 2cp-1-r, so every rank's causal work is equal.
    chunk = L // (2 * cp)
    held = [r["positions"] for r in results]
    assert sorted(p for ps in held for p in ps) == list(range(L))
    for rank, ps in enumerate(held):
        assert ps[0] == rank * chunk and ps[chunk] == (2 * cp - 1 - rank) * chunk
    work = {sum(p + 1 for p in ps) for ps in held}  # keys attended per rank
    assert len(work) == 1


@pytest.mark.slow
def test_cp_attention_compiled_equals_full_attention():
    for r in run_ranks(_attention_matches, 2, True, timeout=400):
        assert r["out"] < 1e-12
        assert max(r["grads"]) < 1e-12


def test_compile_mask_equals_lower_right_bias():
    q, k = torch.randn(1, 1, 4, 8), torch.randn(1, 1, 12, 8)
    v = torch.randn(1, 1, 12, 8)
    a = F.scaled_dot_product_attention(q, k, v, attn_mask=_causal_mask(4, 12, q.device))
    b = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(4, 12))
    assert torch.equal(_causal_mask(4, 12, q.device)[0], torch.tensor([True] * 9 + [False] * 3))
    torch.testing.assert_close(a, b)


def test_shard_sequence_rejects_indivisible_length():
    with pytest.raises(ValueError, match="divisible by 2 \\* cp = 4"):
        shard_sequence(torch.zeros(1, 30), 0, 2)
