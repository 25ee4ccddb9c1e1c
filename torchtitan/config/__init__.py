from torchtitan.config.job_config import MESH_DIM_NAMES, JobConfig
from torchtitan.config.manager import ConfigError, ConfigManager, resolve_gradient_accumulation, to_toml

__all__ = ["MESH_DIM_NAMES", "JobConfig", "ConfigError", "ConfigManager", "resolve_gradient_accumulation", "to_toml"]
