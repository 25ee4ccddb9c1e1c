"""The bad-step guard's decisions, and the skip it makes through the fused AdamW kernel, in one process."""

from __future__ import annotations

import math

import pytest
import torch

from torchtitan.config.job_config import Stability
from torchtitan.stability import BadStepGuard


def _guard(**options) -> BadStepGuard:
    return BadStepGuard(Stability(**options), torch.device("cpu"))


def _decide(guard: BadStepGuard, loss: float, norm: float) -> bool:
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], fused=True)
    bad = guard.decide(opt, torch.tensor(loss, dtype=torch.float64), torch.tensor(norm))
    assert float(opt.found_inf) == float(bad)  # what the kernel is told
    return bool(bad)


def test_non_finite_steps_are_bad_only_when_asked():
    assert _decide(_guard(skip_nonfinite_steps=True), 2.0, math.nan)
    assert _decide(_guard(skip_nonfinite_steps=True), math.inf, 1.0)
    assert not _decide(_guard(skip_nonfinite_steps=True), 2.0, 1.0)
    assert not _decide(_guard(skip_spikes=True, spike_warmup_steps=2), 2.0, math.nan)


def test_a_spike_is_judged_after_the_warm_up_against_accepted_steps():
    guard = _guard(skip_spikes=True, sigma_factor=3.0, rolling_interval_length=8, spike_warmup_steps=4)
    assert not _decide(guard, 50.0, 1.0), "no judgement before spike_warmup_steps accepted steps"
    for loss in (3.0, 3.1, 2.9):
        assert not _decide(guard, loss, 1.0)
    # Accepted so far: 50, 3, 3.1, 2.9 (mean 14.75, std 23.5): an early outlier widens the band past 80.
    assert not _decide(guard, 80.0, 1.0)
    guard = _guard(skip_spikes=True, sigma_factor=3.0, rolling_interval_length=8, spike_warmup_steps=4)
    for loss in (3.0, 3.1, 2.9, 3.0):
        assert not _decide(guard, loss, 1.0 + loss / 100)
    assert _decide(guard, 3.5, 1.03), "0.5 above a mean of 3 with std 0.08"
    assert _decide(guard, 3.0, 5.0), "the grad norm spikes"
    assert not _decide(guard, 3.05, 1.03)
    assert int(guard.loss_stats.count) == 5, "the two spikes are not part of the statistics"
    assert int(guard.skipped) == 2


def test_consecutive_skips_flag_a_rollback():
    guard = _guard(skip_nonfinite_steps=True, max_consecutive_skips=2)
    _decide(guard, math.nan, math.nan)
    _decide(guard, 2.0, 1.0)
    _decide(guard, math.nan, math.nan)
    assert int(guard.rollback_due) == 0 and int(guard.consecutive) == 1
    _decide(guard, math.nan, math.nan)
    assert int(guard.rollback_due) == 1 and int(guard.consecutive) == 2
    _decide(guard, 2.0, 1.0)
    assert int(guard.rollback_due) == 1, "sticky until the rollback"
    guard.after_rollback(3)
    assert int(guard.rollback_due) == 0 and int(guard.data_steps_skipped) == 3


@pytest.mark.parametrize("bad", [False, True])
def test_a_skipped_step_leaves_weights_moments_and_step_count_alone(bad):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1, fused=True)
    guard = _guard(skip_nonfinite_steps=True)
    ref = torch.nn.Linear(4, 3)
    ref.load_state_dict(model.state_dict())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.1, fused=True)
    for step in range(3):
        x = torch.randn(2, 4)
        for m in (model, ref):
            m(x).square().sum().backward()
        if step == 1 and bad:
            model.weight.grad[0, 0] = float("nan")
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        guard.decide(opt, torch.tensor(1.0, dtype=torch.float64), norm)
        opt.step()
        opt.zero_grad()
        if step == 1 and bad:  # the reference skips the step by not taking it
            ref_opt.zero_grad()
        else:
            ref_opt.step()
            ref_opt.zero_grad()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p, q), step
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(opt.state[p][key], ref_opt.state[q][key]), (step, key)


def test_the_guard_needs_the_fused_kernel():
    with pytest.raises(ValueError, match="fused"):
        BadStepGuard.check_optimizer(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], foreach=True))
