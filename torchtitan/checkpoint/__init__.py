"""Checkpointing: DCP save/load with resharding, async saves, seed checkpoints, exports, crash safety."""

from torchtitan.checkpoint.manager import CheckpointManager, export_model_weights, model_view
from torchtitan.checkpoint.preflight import check_checkpoint_config, checkpoint_folder

__all__ = ["CheckpointManager", "check_checkpoint_config", "checkpoint_folder", "export_model_weights", "model_view"]
