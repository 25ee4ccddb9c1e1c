from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import ConfigError, ConfigManager, to_toml

__all__ = ["JobConfig", "ConfigError", "ConfigManager", "to_toml"]
