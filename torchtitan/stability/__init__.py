"""Bad steps and their remedies: skipping on the device, rolling back past a bad data window, z-loss.

``guard.py`` decides before each optimizer step whether to skip it (``running_stats.py`` keeps the
spike detector's statistics); ``rollback.py`` reloads the last checkpoint after too many skips in a
row; ``z_loss.py`` is the optional logit penalty; ``checks.py`` holds the options' preflight checks.
The step's side (where the guard runs, the injected NaN of ``--debug.inject_nonfinite_grad``) is in
``train_step/``. See docs/stability.md.
"""

from torchtitan.stability.guard import BadStepGuard
from torchtitan.stability.running_stats import RunningStats

# z_loss.py is not re-exported: its term builds on train_step's objective, which imports the pipeline
# runner, and the launcher's preflight (which imports this package) must not import pipelining.
__all__ = ["BadStepGuard", "RunningStats"]
