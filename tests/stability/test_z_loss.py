"""z-loss against a direct computation, and the training loss it rides on."""

from __future__ import annotations

import torch

from torchtitan.loss import IGNORE_INDEX, cross_entropy_sum
from torchtitan.stability.z_loss import ZLossTerm, z_loss_sum
from torchtitan.train_step.objective import CrossEntropyTerm, Objective


def _batch():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11) * 4
    labels = torch.randint(0, 11, (2, 5))
    labels[1, 3:] = IGNORE_INDEX
    return logits, labels


def test_value_is_multiplier_times_summed_squared_logsumexp_of_scored_positions():
    logits, labels = _batch()
    want = sum(float(torch.logsumexp(logits[b, t].double(), dim=0)) ** 2
               for b in range(2) for t in range(5) if labels[b, t] != IGNORE_INDEX) * 1e-3
    got = z_loss_sum(logits, labels, 1e-3)
    assert abs(float(got) - want) <= 1e-6 * want, (float(got), want)


def test_gradient_matches_autograd_of_logsumexp():
    logits, labels = _batch()
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    z_loss_sum(a, labels, 0.5).backward()
    scored = (labels != IGNORE_INDEX).float()
    (0.5 * (torch.logsumexp(b, dim=-1).square() * scored).sum()).backward()
    assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-6)


def test_z_loss_term_trains_on_the_sum_and_keeps_the_parts_apart():
    logits, labels = _batch()
    objective = Objective([CrossEntropyTerm(cross_entropy_sum), ZLossTerm(1e-4)])
    total = objective(logits[:1], labels[:1]) + objective(logits[1:], labels[1:])
    loss = objective.logged_loss(total.double(), torch.device("cpu"))  # the cross-entropy alone
    z = objective.take_step_sums(torch.device("cpu"))["z_loss"]
    assert torch.allclose(loss, cross_entropy_sum(logits, labels).double(), rtol=1e-6)
    assert torch.allclose(z, z_loss_sum(logits, labels, 1e-4).double(), rtol=1e-6)
    assert torch.allclose(total.double(), loss + z, rtol=1e-6)
    cpu = torch.device("cpu")
    assert [float(objective.logged_loss(total, cpu)), float(objective.take_step_sums(cpu)["z_loss"])] == [0.0, 0.0]
