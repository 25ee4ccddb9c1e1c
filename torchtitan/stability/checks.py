"""The preflight checks of [stability] and --debug.inject_nonfinite_grad: one line per problem, naming the fix."""

from __future__ import annotations

from torchtitan.config.job_config import Checkpoint, Debug, FaultTolerance, Stability


def stability_problems(s: Stability, *, checkpoint: Checkpoint, ft: FaultTolerance, debug: Debug) -> list[str]:
    """The ``[stability]`` section ``s`` against itself and what it needs of the checkpoint and fault tolerance;
    the drill's ``[debug]`` steps."""
    problems: list[str] = []
    if s.skip_spikes and s.spike_warmup_steps > s.rolling_interval_length:
        problems.append(f"--stability.spike_warmup_steps={s.spike_warmup_steps} is more than "
                        f"--stability.rolling_interval_length={s.rolling_interval_length}: the statistics hold that "
                        "many steps at most; lower the warm-up or lengthen the window")
    if s.skip_spikes and s.sigma_factor <= 0:
        problems.append(f"--stability.sigma_factor={s.sigma_factor}: a spike is this many standard deviations above "
                        "the mean; give a positive number (OLMo uses 6)")
    if s.max_consecutive_skips and not s.guards_steps:
        problems.append(f"--stability.max_consecutive_skips={s.max_consecutive_skips} counts skipped steps, and none "
                        "are skipped: set --stability.skip_nonfinite_steps and/or --stability.skip_spikes")
    if s.max_consecutive_skips and not checkpoint.enable_checkpoint:
        problems.append(f"--stability.max_consecutive_skips={s.max_consecutive_skips} rolls back to the last "
                        "checkpoint: set --checkpoint.enable_checkpoint (or 0 to never roll back)")
    if ft.enable and ft.semi_sync_method != "none" and s.guards_steps:
        problems.append(f"--stability.skip_nonfinite_steps/skip_spikes with --fault_tolerance.semi_sync_method="
                        f"{ft.semi_sync_method}: not supported (the outer step would still apply); turn one off")
    if ft.enable and s.max_consecutive_skips:
        problems.append(f"--stability.max_consecutive_skips={s.max_consecutive_skips} with --fault_tolerance.enable: "
                        "a rollback is not supported across replica groups; use 0 (skipping itself works)")
    bad = [step for step in debug.inject_nonfinite_grad if step < 1]
    if bad:
        problems.append(f"--debug.inject_nonfinite_grad={','.join(map(str, debug.inject_nonfinite_grad))}: "
                        "steps count from 1; give step numbers >= 1")
    return problems
