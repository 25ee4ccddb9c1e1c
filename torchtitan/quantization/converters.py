"""The model converters by name: their preflight problems and their application to a built model."""

from __future__ import annotations

from collections.abc import Callable

import torch

from torchtitan import compat
from torchtitan.config import JobConfig
from torchtitan.quantization import checks

CONVERTERS = ("float8",)


def converter_problems(cfg: JobConfig) -> list[str]:
    """Problems in the config and the installed packages (no device needed): one line each."""
    problems = [f"--model.converters: unknown converter {name!r}; choose from {', '.join(CONVERTERS)}"
                for name in cfg.model.converters if name not in CONVERTERS]
    if len(set(cfg.model.converters)) != len(cfg.model.converters):
        problems.append(f"--model.converters={','.join(cfg.model.converters)}: a converter is named twice")
    if "float8" in cfg.model.converters:
        problem = checks.torchao_problem()
        problems += [problem] if problem else []
        problems += checks.recipe_problems(cfg)
    return problems


def model_problems(cfg: JobConfig, model_factory: Callable[[], torch.nn.Module]) -> list[str]:
    """Problems of the converters' options with the model ``model_factory`` builds (on the meta device)."""
    if "float8" not in cfg.model.converters or not cfg.float8.filter_fqns:
        return []
    from torchtitan.quantization.float8 import unmatched_filter_problem

    with torch.device("meta"):
        model = model_factory()
    linears = [fqn for fqn, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    problem = unmatched_filter_problem(cfg, linears)
    return [problem] if problem else []


def device_problems(cfg: JobConfig) -> list[str]:
    """Problems with this machine's GPU (a launch checks them; a planner plans for its cluster's)."""
    if "float8" not in cfg.model.converters:
        return []
    problem = checks.capability_problem(compat.cuda_capability(), cfg.float8.emulate)
    return [problem] if problem else []


def apply_converters(model: torch.nn.Module, cfg: JobConfig, device_type: str) -> None:
    """Apply ``--model.converters`` in order to ``model`` (a whole model or a stage, built, not parallelized)."""
    for name in cfg.model.converters:
        if name == "float8":
            from torchtitan.quantization.float8 import convert_to_float8

            convert_to_float8(model, cfg, device_type)
