from torchtitan.optim.lr_scheduler import build_lr_scheduler, lr_factor
from torchtitan.optim.optimizer import build_optimizer

__all__ = ["build_lr_scheduler", "build_optimizer", "lr_factor"]
