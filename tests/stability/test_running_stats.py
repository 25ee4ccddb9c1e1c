"""The spike detector's running statistics against a direct computation over the accepted values."""

from __future__ import annotations

import random

import torch

from torchtitan.stability import RunningStats

TRUE = torch.tensor(True)
FALSE = torch.tensor(False)


def test_mean_and_std_over_the_last_window_of_accepted_values():
    rng = random.Random(0)
    stats, window, accepted = RunningStats(5, torch.device("cpu")), 5, []
    for i in range(23):
        value, accept = rng.gauss(3.0, 2.0), rng.random() < 0.7
        stats.add(torch.tensor(value, dtype=torch.float64), TRUE if accept else FALSE)
        if accept:
            accepted.append(value)
        held = torch.tensor(accepted[-window:], dtype=torch.float64)
        mean, std = stats.mean_std()
        assert int(stats.count) == len(accepted), i
        if len(held) >= 2:
            want_std, want_mean = torch.std_mean(held)  # the sample standard deviation (n - 1)
            assert torch.allclose(mean, want_mean, rtol=1e-12, atol=1e-12), (i, mean, want_mean)
            assert torch.allclose(std, want_std, rtol=1e-12, atol=1e-12), (i, std, want_std)
        elif len(held) == 1:
            assert float(mean) == accepted[0] and float(std) == 0.0


def test_state_round_trip():
    a, b = RunningStats(4, torch.device("cpu")), RunningStats(4, torch.device("cpu"))
    for v in (1.0, 2.0, 4.0, 8.0, 16.0):
        a.add(torch.tensor(v), TRUE)
    b.load_state_dict({k: v.clone() for k, v in a.state_dict().items()})
    assert [float(x) for x in b.mean_std()] == [float(x) for x in a.mean_std()]
    a.add(torch.tensor(32.0), TRUE)
    b.add(torch.tensor(32.0), TRUE)
    assert torch.equal(a.values, b.values) and int(a.count) == int(b.count) == 6
