"""Checkpointing: DCP save/load with resharding, async saves, seed checkpoints, exports, crash safety."""

from torchtitan.checkpoint.formats import export_model_weights, read_model_weights
from torchtitan.checkpoint.manager import CheckpointManager
from torchtitan.checkpoint.selection import checkpoint_folder
from torchtitan.checkpoint.stage_view import model_view
from torchtitan.checkpoint.store import CheckpointKind

__all__ = ["CheckpointKind", "CheckpointManager", "checkpoint_folder", "export_model_weights", "model_view",
           "read_model_weights"]
