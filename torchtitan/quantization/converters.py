"""The model converters by name: their preflight problems and their application to a built model.

Each function reads the ``[model]`` section (the converters, and the model's name in messages) and the
``[float8]`` section, nothing else of the job.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from torchtitan import compat
from torchtitan.config.job_config import Float8, Model
from torchtitan.quantization import checks

CONVERTERS = ("float8",)


def converter_problems(model_cfg: Model, f8: Float8) -> list[str]:
    """Problems in the config and the installed packages (no device needed): one line each."""
    converters = model_cfg.converters
    problems = [f"--model.converters: unknown converter {name!r}; choose from {', '.join(CONVERTERS)}"
                for name in converters if name not in CONVERTERS]
    if len(set(converters)) != len(converters):
        problems.append(f"--model.converters={','.join(converters)}: a converter is named twice")
    if "float8" in converters:
        problem = checks.torchao_problem()
        problems += [problem] if problem else []
        problems += checks.recipe_problems(f8)
    return problems


def model_label(model_cfg: Model) -> str:
    """The model as messages name it: family and flavor."""
    return f"{model_cfg.name} {model_cfg.flavor}"


def model_problems(model_cfg: Model, f8: Float8, model_factory: Callable[[], torch.nn.Module]) -> list[str]:
    """Problems of the converters' options with the model ``model_factory`` builds (on the meta device)."""
    if "float8" not in model_cfg.converters or not f8.filter_fqns:
        return []
    from torchtitan.quantization.float8 import routed_experts, unmatched_filter_problem

    with torch.device("meta"):
        model = model_factory()
    linears = [fqn for fqn, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    problem = unmatched_filter_problem(f8, [*linears, *routed_experts(model)], model_label(model_cfg))
    return [problem] if problem else []


def device_problems(model_cfg: Model, f8: Float8, model_factory: Callable[[], torch.nn.Module]) -> list[str]:
    """Problems with this machine's GPU (a launch checks them; a planner plans for its cluster's): FP8 tensor
    cores, and the FP8 grouped GEMM for routed experts that would take it (``model_factory`` builds the model on
    the meta device)."""
    if "float8" not in model_cfg.converters:
        return []
    capability = compat.cuda_capability()
    problem = checks.capability_problem(capability, f8.emulate)
    if problem is not None or capability is None or f8.emulate:
        return [problem] if problem else []
    missing = compat.fp8_grouped_mm_missing()
    if missing is None:
        return []
    from torchtitan.quantization.float8 import filter_patterns, routed_experts

    with torch.device("meta"):
        model = model_factory()
    patterns = filter_patterns(f8)
    experts = [fqn for fqn in routed_experts(model, float8_capable_only=True)
               if not any(pattern in fqn for pattern in patterns)]
    return [checks.experts_kernel_problem(experts, missing, model_label(model_cfg))] if experts else []


def apply_converters(model: torch.nn.Module, model_cfg: Model, f8: Float8, device_type: str) -> None:
    """Apply ``--model.converters`` in order to ``model`` (a whole model or a stage, built, not parallelized)."""
    for name in model_cfg.converters:
        if name == "float8":
            from torchtitan.quantization.float8 import convert_to_float8

            convert_to_float8(model, f8, device_type, model_label(model_cfg))
