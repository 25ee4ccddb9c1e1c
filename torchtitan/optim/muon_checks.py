"""What ``--optimizer.name Muon`` cannot do yet, refused by the launch preflight before any process group."""

from __future__ import annotations

from torchtitan.config import JobConfig
from torchtitan.optim.qk_clip_checks import qk_clip_problems


def muon_problems(cfg: JobConfig) -> list[str]:
    """One line per Muon setting that cannot apply; none when the optimizer is not Muon."""
    o = cfg.optimizer
    if o.name not in ("Muon", "MuonClip"):  # MuonClip is Muon, then QK-clip
        return []
    problems = qk_clip_problems(cfg)
    if o.lr <= 0:
        problems.append(f"--optimizer.lr={o.lr}: Muon needs a positive learning rate")
    if o.muon_momentum >= 1:
        problems.append(f"--optimizer.muon_momentum={o.muon_momentum}: Muon's momentum is a fraction in [0, 1), "
                        "e.g. 0.95")
    if cfg.stability.guards_steps:
        problems.append("--stability.skip_nonfinite_steps / --stability.skip_spikes: a skipped step needs the fused "
                        "AdamW kernel, which Muon lacks; turn both off with Muon")
    return problems
