"""What ``--optimizer.name Muon`` cannot do yet, refused by the launch preflight before any process group."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from torchtitan.config import JobConfig
from torchtitan.config.job_config import Optimizer as OptimizerConfig
from torchtitan.optim.muon import MUON_OPTIMIZERS
from torchtitan.optim.qk_clip_checks import qk_clip_problems


def muon_problems(cfg: JobConfig) -> list[str]:
    """One line per Muon setting that cannot apply; none when the optimizer is not Muon."""
    o = cfg.optimizer
    if o.name not in MUON_OPTIMIZERS:  # MuonClip is Muon, then QK-clip
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


def muon_model_problems(o: OptimizerConfig, model_factory: Callable[[], nn.Module], model_label: str) -> list[str]:
    """One line per problem of the options that choose Muon's parameters (``--optimizer.muon_split_heads``,
    ``--optimizer.muon_adamw_fqns``): set for another optimizer, an empty pattern (it would match every
    parameter), or a pattern in no parameter's name of the model ``model_factory`` builds (on the meta device)."""
    if o.name not in MUON_OPTIMIZERS:
        unused = [f"--optimizer.{name}" for name, on in (("muon_split_heads", o.muon_split_heads),
                                                          ("muon_adamw_fqns", bool(o.muon_adamw_fqns))) if on]
        return [f"{option}: applies to --optimizer.name Muon only, not {o.name}; drop it or choose Muon"
                for option in unused]
    if not o.muon_adamw_fqns:
        return []
    if "" in o.muon_adamw_fqns:
        return ["--optimizer.muon_adamw_fqns: an empty pattern is part of every parameter's name and would send "
                "them all to AdamW; drop it"]
    with torch.device("meta"):
        names = [name for name, _ in model_factory().named_parameters()]
    unmatched = [p for p in o.muon_adamw_fqns if not any(p in name for name in names)]
    if not unmatched:
        return []
    example = next((name for name in names if ".attention." in name), names[0])
    return [f"--optimizer.muon_adamw_fqns: no parameter of {model_label} has {' or '.join(map(repr, unmatched))} "
            f"in its name, so it sends nothing to AdamW; name part of a parameter's FQN such as {example}, or drop it"]
