"""The CPU loss path scores logits in row slices and grouped-query attention reads K/V heads in
place: both must give the gradients of the one-call forms (bitwise for the loss, to rounding
for attention's k and v), or training would change."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torchtitan import loss as loss_module
from torchtitan.loss import IGNORE_INDEX, cross_entropy_sum
from torchtitan.models.llama3.model import Attention, repeat_kv


def _one_call(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)


def test_sliced_cross_entropy_has_the_one_call_gradient_bitwise():
    torch.manual_seed(0)
    logits = torch.randn(3, 700, 512)  # 2100 rows of 2 KiB: several 1 MiB slices and a short last one
    labels = torch.randint(0, 512, (3, 700))
    labels[0, :5] = IGNORE_INDEX
    rows = loss_module._CPU_SLICE_BYTES // (512 * 4)
    assert logits.shape[0] * logits.shape[1] > 3 * rows  # the sliced branch runs
    grads = []
    for fn in (cross_entropy_sum, _one_call):
        x = logits.clone().requires_grad_()
        value = fn(x, labels)
        (value * 0.37).backward()
        grads.append((value.detach(), x.grad))
    assert torch.equal(grads[0][1], grads[1][1])
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-6, atol=0)


def test_grouped_query_attention_matches_repeated_heads():
    torch.manual_seed(0)
    q = torch.randn(2, 8, 64, 16, requires_grad=True)
    k = torch.randn(2, 2, 64, 16, requires_grad=True)
    v = torch.randn(2, 2, 64, 16, requires_grad=True)
    upstream = torch.randn(2, 8, 64, 16)
    results = []
    for fn in (lambda: Attention.sdpa(None, q, k, v),
               lambda: F.scaled_dot_product_attention(q, repeat_kv(k, 4), repeat_kv(v, 4), is_causal=True)):
        q.grad = k.grad = v.grad = None
        out = fn()
        out.backward(upstream)
        results.append((out.detach(), q.grad, k.grad, v.grad))
    assert torch.equal(results[0][0], results[1][0])  # same forward bitwise
    for a, b in zip(results[0][1:], results[1][1:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
