"""Checkpointing: DCP save/load with resharding, async saves, seed checkpoints, exports, crash safety.

The names below load their modules on first use (PEP 562): the launcher's preflight imports this package's
light modules (locations, the checkpoint listing) in a process of its own, and torch's DCP, which the
manager and the formats import, costs it about a second of CPU it has no use for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchtitan.checkpoint.formats import export_model_weights, read_model_weights
    from torchtitan.checkpoint.manager import CheckpointManager
    from torchtitan.checkpoint.selection import checkpoint_folder
    from torchtitan.checkpoint.stage_view import model_view
    from torchtitan.checkpoint.store import CheckpointKind

_HOMES = {"CheckpointKind": "store", "CheckpointManager": "manager", "checkpoint_folder": "selection",
          "export_model_weights": "formats", "model_view": "stage_view", "read_model_weights": "formats"}
__all__ = ["CheckpointKind", "CheckpointManager", "checkpoint_folder", "export_model_weights", "model_view",
           "read_model_weights"]


def __getattr__(name: str) -> object:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
