"""[stability] on CUDA (the ``gpu`` tier): the guard's skip through CUDA's fused AdamW, without a host sync.

On CPU the fused kernel reads ``found_inf`` from host memory; on CUDA it reads it on the device, and
the guard's decision (statistics, comparisons, counters) must queue no synchronising op. Checked with
``torch.cuda.set_sync_debug_mode("error")``, which raises at a synchronising call.
"""

from __future__ import annotations

import pytest
import torch

from torchtitan.config.job_config import Stability
from torchtitan.stability import BadStepGuard
from torchtitan.stability.z_loss import z_loss_sum

pytestmark = pytest.mark.gpu


def _train(bad_step: int | None, guard_on: bool) -> tuple[list[list[torch.Tensor]], BadStepGuard | None]:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1, fused=True)
    guard = BadStepGuard(Stability(skip_nonfinite_steps=True, skip_spikes=True, spike_warmup_steps=2,
                                   rolling_interval_length=4), dev) if guard_on else None
    states = []
    for step in range(5):
        loss = model(torch.randn(8, 64, device=dev)).square().mean()
        loss.backward()
        if step == bad_step:
            model.weight.grad[0, 0] = float("nan")
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        torch.cuda.set_sync_debug_mode("error")
        try:
            if guard is not None:
                guard.decide(opt, loss.detach().double(), norm)
            opt.step()
            opt.zero_grad()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        states.append([p.detach().clone() for p in model.parameters()]
                      + [v.clone() for p in model.parameters() for v in opt.state[p].values()])
    return states, guard


def test_guard_without_bad_steps_trains_bitwise_as_without_it():
    off, _ = _train(None, guard_on=False)
    on, guard = _train(None, guard_on=True)
    assert guard is not None and int(guard.skipped) == 0 and int(guard.loss_stats.count) == 5
    for a, b in zip(off, on, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_nan_gradient_is_skipped_bitwise():
    states, guard = _train(2, guard_on=True)
    assert guard is not None and int(guard.skipped) == 1
    assert all(torch.equal(x, y) for x, y in zip(states[1], states[2], strict=True))
    assert not torch.equal(states[2][0], states[3][0])
    assert all(bool(torch.isfinite(t).all()) for t in states[-1])


def test_z_loss_on_cuda():
    logits = torch.randn(2, 16, 1000, device="cuda") * 5
    labels = torch.randint(0, 1000, (2, 16), device="cuda")
    labels[0, :3] = -100
    want = 1e-3 * (torch.logsumexp(logits.double(), -1).square() * (labels != -100)).sum()
    assert abs(float(z_loss_sum(logits, labels, 1e-3)) - float(want)) <= 1e-5 * float(want)
