"""[stability]'s and --debug's preflight refusals: one line each, naming the option and the fix."""

from __future__ import annotations

import pytest

from torchtitan.config import ConfigManager
from torchtitan.preflight import check_config

SKIP = "--stability.skip_nonfinite_steps"
SPIKES = "--stability.skip_spikes"
SAVES = "--checkpoint.enable_checkpoint"


@pytest.mark.parametrize("args, start, fix", [
    ([SPIKES, "--stability.spike_warmup_steps=10", "--stability.rolling_interval_length=4"],
     "--stability.spike_warmup_steps=10 is more than --stability.rolling_interval_length=4", "lengthen the window"),
    ([SPIKES, "--stability.sigma_factor=0"], "--stability.sigma_factor=0.0", "give a positive number"),
    (["--stability.max_consecutive_skips=3", SAVES], "--stability.max_consecutive_skips=3 counts skipped steps",
     "set --stability.skip_nonfinite_steps"),
    ([SKIP, "--stability.max_consecutive_skips=3"], "--stability.max_consecutive_skips=3 rolls back",
     "set --checkpoint.enable_checkpoint"),
    ([SKIP, "--fault_tolerance.enable", "--fault_tolerance.semi_sync_method=diloco"],
     "--stability.skip_nonfinite_steps/skip_spikes with --fault_tolerance.semi_sync_method=diloco", "turn one off"),
    ([SKIP, SAVES, "--stability.max_consecutive_skips=2", "--fault_tolerance.enable"],
     "--stability.max_consecutive_skips=2 with --fault_tolerance.enable", "use 0"),
    (["--debug.inject_nonfinite_grad=0,5"], "--debug.inject_nonfinite_grad=0,5", "steps count from 1"),
])
def test_bad_values_are_one_line_each(args, start, fix):
    problems = [p for p in check_config(ConfigManager().parse_args(args)) if "stability" in p or "debug" in p]
    assert len(problems) == 1 and problems[0].startswith(start) and fix in problems[0], problems


def test_good_values_pass():
    args = [SKIP, SPIKES, "--stability.max_consecutive_skips=4", SAVES, "--stability.z_loss_multiplier=1e-4",
            "--debug.inject_nonfinite_grad=5,9", "--stability.spike_warmup_steps=8",
            "--stability.rolling_interval_length=8"]
    assert check_config(ConfigManager().parse_args(args)) == []


def test_the_parser_refuses_negative_and_non_finite_values():
    from torchtitan.config import ConfigError

    for arg in ("--stability.z_loss_multiplier=-1", "--stability.z_loss_multiplier=nan",
                "--stability.rolling_interval_length=1", "--stability.max_consecutive_skips=-1"):
        with pytest.raises(ConfigError):
            ConfigManager().parse_args([arg])
