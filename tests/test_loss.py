"""The loss path: on CPU the logits are scored in row slices, which must give the gradient of
one call over the whole block bitwise (and its value to rounding), or training would change."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torchtitan import loss as loss_module
from torchtitan.loss import IGNORE_INDEX, cross_entropy_sum


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
