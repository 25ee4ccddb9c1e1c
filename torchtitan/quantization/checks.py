"""What ``--model.converters float8`` needs, checked before any process group: one line per problem.

torchao must import and lie in the tested range; the recipe must allow what the ``[float8]``
options ask (the FP8 all-gather needs one scale per tensor); a GPU must have FP8 tensor
cores (SM 8.9: Ada, Hopper and later) unless the products are emulated; and routed experts that would take
FP8 grouped GEMMs there need torch's ``_scaled_grouped_mm`` and torchao's grouped GEMM.
"""

from __future__ import annotations

import importlib
from importlib import metadata

from torchtitan.config.job_config import Float8

# The torchao releases this project is tested with ([lower, upper)); pyproject.toml declares the same.
TORCHAO_TESTED = ((0, 18), (0, 19))
TORCHAO_PIN = "torchao>=0.18,<0.19"
MIN_FP8_CAPABILITY = (8, 9)  # the first NVIDIA generation with FP8 tensor cores (Ada; Hopper is 9.0)


def _release(version: str) -> tuple[int, int] | None:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def torchao_problem() -> str | None:
    """Why the installed torchao cannot run Float8 here, or None."""
    fix = f"install it with pip install '{TORCHAO_PIN}' (scripts/install.sh does)"
    try:
        importlib.import_module("torchao.float8")
    except ImportError as e:
        return f"--model.converters=float8 needs torchao, which does not import ({e}); {fix}"
    try:
        version = metadata.version("torchao")
    except metadata.PackageNotFoundError:
        return f"--model.converters=float8: torchao imports but has no package metadata (its version is unknown); {fix}"
    (low, high), release = TORCHAO_TESTED, _release(version)
    if release is None or not low <= release < high:
        return (f"--model.converters=float8: torchao {version} is not a tested version (tested: "
                f"{low[0]}.{low[1]}.x); {fix}")
    return None


def recipe_problems(f8: Float8) -> list[str]:
    """The ``[float8]`` options against each other (the recipe name itself is checked as a choice)."""
    problems: list[str] = []
    if f8.enable_fsdp_float8_all_gather and f8.recipe_name != "tensorwise":
        problems.append(f"--float8.enable_fsdp_float8_all_gather with --float8.recipe_name={f8.recipe_name}: the FP8 "
                        "all-gather needs one scale per tensor; use --float8.recipe_name=tensorwise or turn the "
                        "all-gather off")
    if f8.precompute_float8_dynamic_scale_for_fsdp and not f8.enable_fsdp_float8_all_gather:
        problems.append("--float8.precompute_float8_dynamic_scale_for_fsdp precomputes the scales of the FP8 "
                        "all-gather; also set --float8.enable_fsdp_float8_all_gather (tensorwise), or drop it")
    return problems


def capability_problem(capability: tuple[int, int] | None, emulate: bool) -> str | None:
    """A GPU of ``capability`` (None: no GPU) without FP8 tensor cores, unless emulated."""
    if capability is None or emulate or capability >= MIN_FP8_CAPABILITY:
        return None
    major, minor = capability
    need = f"{MIN_FP8_CAPABILITY[0]}.{MIN_FP8_CAPABILITY[1]}"
    return (f"--model.converters=float8 on a GPU of compute capability {major}.{minor}: FP8 products need SM {need} "
            "or newer (Ada, Hopper, Blackwell); set --float8.emulate (no speed-up) or drop the converter")


def experts_kernel_problem(experts: list[str], missing: str, model_label: str) -> str:
    """The routed experts ``experts`` of ``model_label`` would take FP8 grouped GEMMs on this GPU, but ``missing``
    says why the kernel is not there."""
    shown = experts[0] + (f" and {len(experts) - 1} more" if len(experts) > 1 else "")
    suffix = ".".join(experts[0].split(".")[-2:])  # "feed_forward.experts": not the shared experts
    return (f"--model.converters=float8: the routed experts of {model_label} ({shown}) take FP8 grouped GEMMs on "
            f"this GPU, but {missing}; install torch and torchao with it ({TORCHAO_PIN}), set --float8.emulate "
            f"(the experts stay in high precision), keep them in high precision with --float8.filter_fqns="
            f"{suffix}, or drop float8 from --model.converters")
