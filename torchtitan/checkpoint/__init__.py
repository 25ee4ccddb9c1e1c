"""Checkpointing: DCP save/load with resharding, async saves, seed checkpoints, exports, crash safety."""

from torchtitan.checkpoint.manager import CheckpointManager, export_model_weights, model_view
from torchtitan.checkpoint.selection import checkpoint_folder

__all__ = ["CheckpointManager", "checkpoint_folder", "export_model_weights", "model_view"]
