"""What ``--optimizer.name MuonClip`` refuses before any process group (docs/optimizers.md, "QK-clip (MuonClip)")."""

from __future__ import annotations

from torchtitan.config import JobConfig


def qk_clip_problems(cfg: JobConfig) -> list[str]:
    """One line per QK-clip setting that cannot apply; none when the optimizer is not MuonClip."""
    o, opt = cfg.optimizer, "--optimizer.name=MuonClip"
    if o.name != "MuonClip":
        return []
    problems = []
    if o.qk_clip_threshold <= 0:
        problems.append(f"--optimizer.qk_clip_threshold={o.qk_clip_threshold}: the largest attention logit a head "
                        "may reach must be positive (e.g. 100)")
    if cfg.fault_tolerance.enable:
        problems.append(f"{opt} with --fault_tolerance.enable: the clip's all-reduce spans one replica group, so "
                        "the groups would clip their replicas apart; use --optimizer.name Muon")
    if cfg.parallelism.context_parallel_degree > 1:
        problems.append(f"{opt} with --parallelism.context_parallel_degree="
                        f"{cfg.parallelism.context_parallel_degree}: the max-logit measurement needs every key of "
                        "a sequence, which context parallelism keeps on other ranks; use --optimizer.name Muon")
    attention = _attention_problem(cfg)
    if attention:
        problems.append(f"{opt}: {attention}; use --optimizer.name Muon")
    return problems


def _attention_problem(cfg: JobConfig) -> str | None:
    # Imported here: the launch preflight imports the optimizers, not the models' modules.
    from torchtitan.models.registry import model_args

    try:
        args = model_args(cfg.model.name, cfg.model.flavor)
    except ValueError:  # an unknown model or flavor: check_config names it
        return None
    refusal = args.attention().qk_clip_refusal()
    return f"{cfg.model.name}: {refusal}" if refusal else None
