"""torchft internals (torchft 0.2): the inner-step counter and reference parameters of LocalSGD / DiLoCo."""

from __future__ import annotations

from typing import Any

import torch

from torchtitan.compat.errors import missing


def _attr(algo: Any, name: str) -> Any:
    if not hasattr(algo, name):
        raise missing(f"{type(algo).__name__}.{name}", "torchft")
    return getattr(algo, name)


def semi_sync_local_step(algo: Any) -> int:
    """Inner steps since the last sync (0 right after one) of a torchft ``LocalSGD``/``DiLoCo``."""
    return int(_attr(algo, "_local_step"))


def set_semi_sync_local_step(algo: Any, step: int) -> None:
    """Restore the inner-step counter from a checkpoint."""
    _attr(algo, "_local_step")
    algo._local_step = step


def semi_sync_reference(algo: Any, fragment: int, name: str) -> torch.Tensor:
    """A DiLoCo fragment's reference (global) copy of parameter ``name`` (this rank's shard)."""
    fragments = _attr(algo, "_fragments")
    if not hasattr(fragments[fragment], "original_parameters"):
        raise missing("_StreamingDiLoCoFragment.original_parameters", "torchft")
    return fragments[fragment].original_parameters[name]


def semi_sync_save_reference(algo: Any) -> None:
    """Make DiLoCo's reference parameters the model's current ones."""
    _attr(algo, "_save_parameters")()
