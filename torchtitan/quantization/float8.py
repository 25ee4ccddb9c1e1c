"""Float8 linears with torchao: which linears convert, the conversion, and the scales after each step.

A linear converts unless its FQN contains one of ``ALWAYS_HIGH_PRECISION`` (the output head and
the MoE router gates, which decide the loss and the routing and are small) or of
``--float8.filter_fqns`` (added to those), or a dimension is not a multiple of 16 (what FP8 tensor
cores take). torchao's ``Float8Linear`` keeps the parameter (same FQN, dtype and values), so
checkpoints and Hugging Face exports do not change (with the FP8 all-gather, see
``float8_state.py``); it casts weight, input and output gradient to FP8 with dynamic scales
computed over the whole tensor (a DTensor's amax is reduced over its mesh), so every layout casts
with the same scales.

On a CPU build of torch without an FP8 ``_scaled_mm`` (and wherever ``--float8.emulate`` asks)
the casts stay real and the products run in high precision. The routed experts of an MoE model
compute FP8 grouped GEMMs on CUDA (``models/moe/float8_experts.py``); elsewhere they stay in high precision.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Callable, Iterable

import torch
from torch import nn

from torchtitan import compat
from torchtitan.config.job_config import Float8, Model

logger = logging.getLogger(__name__)

# Linears that stay in high precision whatever ``--float8.filter_fqns`` adds: the output head (it sets the
# loss) and the MoE router gates (they set the routing, and the router computes in float32).
ALWAYS_HIGH_PRECISION = ("output", "router.gate")


def emulated(f8: Float8, device_type: str) -> bool:
    """Whether the FP8 products run emulated: asked for, or no FP8 matmul on this CPU build."""
    return f8.emulate or not compat.scaled_mm_supported(device_type)


def float8_linear_config(f8: Float8, device_type: str):  # noqa: ANN201 - torchao's Float8LinearConfig
    """torchao's config for the ``[float8]`` section ``f8`` on ``device_type``."""
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(f8.recipe_name)
    return dataclasses.replace(config, emulate=emulated(f8, device_type),
                               enable_fsdp_float8_all_gather=f8.enable_fsdp_float8_all_gather)


def filter_patterns(f8: Float8) -> tuple[str, ...]:
    """Every FQN pattern that keeps a linear in high precision: the built-in ones, then the user's."""
    return (*ALWAYS_HIGH_PRECISION, *f8.filter_fqns)


def unmatched_filter_problem(f8: Float8, linear_fqns: Iterable[str], model_label: str) -> str | None:
    """One line naming ``--float8.filter_fqns`` and its patterns that are part of no FQN of ``linear_fqns`` (the
    linears and routed experts of the model ``model_label`` names: each would filter nothing), or None; the
    built-in patterns pass (a model may have no router)."""
    fqns = list(linear_fqns)
    unmatched = [p for p in f8.filter_fqns
                 if p not in ALWAYS_HIGH_PRECISION and not any(p in fqn for fqn in fqns)]
    if not unmatched:
        return None
    example = f" such as {fqns[0]}" if fqns else ""
    return (f"--float8.filter_fqns: no linear layer or routed-experts module of {model_label} has "
            f"{' or '.join(map(repr, unmatched))} in its FQN, so it filters nothing; name part of such an FQN"
            f"{example}, or drop it")


def skip_reason(module: nn.Module, fqn: str, filter_fqns: Iterable[str]) -> str | None:
    """Why the linear ``fqn`` stays in high precision (None: it converts); not a linear: 'not a linear'."""
    if not isinstance(module, nn.Linear):
        return "not a linear"
    if any(pattern in fqn for pattern in filter_fqns):
        return "filtered"
    out_features, in_features = module.weight.shape
    if out_features % 16 or in_features % 16:
        return "dims not multiples of 16"
    return None


def convert_to_float8(model: nn.Module, f8: Float8, device_type: str, model_label: str) -> dict[str, int]:
    """Swap ``model``'s eligible linears for Float8 linears in place; log and return the counts.
    ``model_label`` names the model in the one line that refuses a filter matching none of its linears.

    Returns ``{"converted": n, <reason>: n, "experts_fp8": n, "experts_high_precision": n}``.
    """
    from torchao.float8 import convert_to_float8_training

    patterns = filter_patterns(f8)
    reasons: dict[str, str | None] = {
        fqn: skip_reason(m, fqn, patterns) for fqn, m in model.named_modules() if isinstance(m, nn.Linear)}
    # Preflight refuses this first; a direct caller is told here, before the model changes.
    problem = unmatched_filter_problem(f8, [*reasons, *routed_experts(model)], model_label)
    if problem is not None:
        raise ValueError(problem)

    def keep(module: nn.Module, fqn: str) -> bool:
        return reasons.get(fqn, "not a linear") is None

    convert_to_float8_training(model, config=float8_linear_config(f8, device_type), module_filter_fn=keep)
    counts = Counter("converted" if r is None else r for r in reasons.values())
    _log(f8, device_type, counts, [fqn for fqn, r in reasons.items() if r is not None])
    experts = _convert_experts(model, f8, device_type, patterns)
    _log_experts(experts)
    counts.update({"experts_fp8": experts.pop(None, 0), "experts_high_precision": sum(experts.values())})
    return {key: n for key, n in counts.items() if n}


def routed_experts(model: nn.Module, float8_capable_only: bool = False) -> list[str]:
    """The FQNs of ``model``'s routed-experts modules (those with a ``to_float8``: models/moe/experts.py); with
    ``float8_capable_only``, those whose ``to_float8`` takes FP8 grouped GEMMs where they run."""
    return [fqn for fqn, m in model.named_modules() if callable(getattr(m, "to_float8", None))
            and (not float8_capable_only or getattr(m, "float8_capable", False))]


def expert_skip_reason(module: nn.Module, fqn: str, patterns: Iterable[str], device_type: str,
                       emulate: bool) -> str | None:
    """Why the routed experts ``fqn`` stay in high precision (None: they take FP8 grouped GEMMs here)."""
    if not getattr(module, "float8_capable", False):
        return f"{type(module).__name__} is not checked in FP8 (biased, clamped products)"
    if any(pattern in fqn for pattern in patterns):
        return "filtered by --float8.filter_fqns"
    return compat.fp8_grouped_mm_skip_reason(device_type, emulate)


def _convert_experts(model: nn.Module, f8: Float8, device_type: str, patterns: Iterable[str]
                     ) -> Counter[str | None]:
    """Ask each routed-experts module (models/moe/experts.py) not filtered to take FP8 grouped GEMMs; count the
    modules by why they stay in high precision (None: they take them)."""
    found: Counter[str | None] = Counter()
    emulate = emulated(f8, device_type)
    for fqn in routed_experts(model):
        module = model.get_submodule(fqn)
        reason = expert_skip_reason(module, fqn, patterns, device_type, emulate)
        to_float8 = getattr(module, "to_float8")  # noqa: B009 - nn.Module's stubs type attributes as Tensor | Module
        if reason is None and not to_float8(device_type, emulate):
            reason = f"{type(module).__name__}.to_float8 declined"
        found[reason] += 1
    return found


def _log_experts(found: Counter[str | None]) -> None:
    """One line for the experts that take FP8 grouped GEMMs, one per reason the others do not."""
    for reason, n in found.items():
        if reason is None:
            logger.info("Float8: the routed experts of %d MoE layers run FP8 grouped GEMMs (rowwise scales)", n)
        else:
            logger.info("Float8: FP8 grouped GEMMs for the routed experts of %d MoE layers: skipped, %s (the "
                        "high-precision grouped product runs)", n, reason)


def _log(f8: Float8, device_type: str, counts: Counter[str], kept: list[str]) -> None:
    total = sum(counts.values())
    skipped = ", ".join(f"{n} {why}" for why, n in counts.items() if why != "converted")
    shown = ", ".join(kept[:4]) + (f" and {len(kept) - 4} more" if len(kept) > 4 else "")
    logger.info("Float8 (%s%s%s): %d of %d linear layers converted%s", f8.recipe_name,
                ", FP8 all-gather" if f8.enable_fsdp_float8_all_gather else "",
                ", emulated" if emulated(f8, device_type) else "", counts["converted"], total,
                f"; high precision: {skipped} ({shown})" if kept else "")


def precompute_scales_hook(model_parts: list[nn.Module]) -> Callable[..., None]:
    """An optimizer step post-hook computing every FP8-all-gathered weight's scale in one all-reduce."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    def hook(*_: object) -> None:
        for part in model_parts:
            precompute_float8_dynamic_scale_for_fsdp(part)

    return hook


def install_after_step(optimizer: torch.optim.Optimizer, model_parts: list[nn.Module], model_cfg: Model,
                       f8: Float8) -> None:
    """Register the scale precomputation after every optimizer step, where ``[float8]`` asks for it."""
    if "float8" in model_cfg.converters and f8.precompute_float8_dynamic_scale_for_fsdp:
        optimizer.register_step_post_hook(precompute_scales_hook(model_parts))
        logger.info("Float8: the all-gathered weights' scales are computed after each optimizer step")
