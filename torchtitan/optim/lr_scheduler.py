"""Warmup-stable-decay (WSD) learning-rate schedule.

The schedule is expressed as a multiplicative factor of the peak lr so that a
single ``LambdaLR`` covers every param group. Steps are 1-based training
steps: step 1 is the first optimizer step.

    steps 1 .. W                 linear warmup, factor s / (W + 1)
    steps W+1 .. T-D             stable, factor 1
    steps T-D+1 .. T             decay from 1 towards lr_min, reaching
                                 lr_min exactly at step T
    steps > T                    held at lr_min

where W = warmup_steps, D = decay steps and T = total_steps.

On resume the schedule is this run's (its config), continued from the checkpoint's step; the
checkpoint's settings are only compared with it, and a change is logged in one WARNING line.
"""

import functools
import logging
import math
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

logger = logging.getLogger(__name__)

DECAY_TYPES = ("linear", "cosine", "sqrt")

# A schedule's settings as a resume compares them, by the config option that sets each.
ScheduleSettings = dict[str, float | int | str | None]


def resolve_decay_steps(
    *, total_steps: int, warmup_steps: int, decay_ratio: float | None
) -> int:
    """Number of decay steps; ``decay_ratio=None`` decays over all post-warmup steps."""
    if decay_ratio is None:
        return total_steps - warmup_steps
    # round() rather than int(): 0.29 * 100 is 28.999... in floating point.
    return round(decay_ratio * total_steps)


def _decay_curve(progress: float, decay_type: str) -> float:
    """Fraction of the (peak - min) gap still left at ``progress`` in [0, 1]."""
    if decay_type == "linear":
        return 1.0 - progress
    if decay_type == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if decay_type == "sqrt":
        return 1.0 - math.sqrt(progress)
    raise ValueError(f"decay_type must be one of {DECAY_TYPES}, got {decay_type!r}")


def lr_factor(
    step: int,
    *,
    warmup_steps: int,
    decay_steps: int,
    total_steps: int,
    decay_type: str,
    lr_min: float,
) -> float:
    """Multiplier of the peak lr used at 1-based training ``step``."""
    if step <= warmup_steps:
        # Dividing by W + 1 keeps step 1 above zero (a zero lr would waste a
        # step) and leaves the first full-lr step to the stable/decay phase.
        return step / (warmup_steps + 1)
    decay_start = total_steps - decay_steps
    # decay_steps == 0 means no decay at all, even past total_steps (the
    # scheduler is stepped once more after the last training step).
    if step <= decay_start or decay_steps == 0:
        return 1.0
    # progress is 1/D at the first decay step and exactly 1 at step T.
    progress = min((step - decay_start) / decay_steps, 1.0)
    return lr_min + (1.0 - lr_min) * _decay_curve(progress, decay_type)


def _factor_for_epoch(epoch: int, **schedule: float | int | str) -> float:
    # LambdaLR passes its last_epoch, which is 0 while step 1 runs
    # (scheduler.step() is called after each optimizer.step()).
    return lr_factor(epoch + 1, **schedule)  # type: ignore[arg-type]


def validate_schedule(
    *,
    warmup_steps: int,
    decay_ratio: float | None,
    decay_type: str,
    lr_min: float,
    total_steps: int,
) -> None:
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError(
            f"warmup_steps must be in [0, total_steps={total_steps}], got {warmup_steps}"
        )
    if decay_type not in DECAY_TYPES:
        raise ValueError(f"decay_type must be one of {DECAY_TYPES}, got {decay_type!r}")
    if not 0.0 <= lr_min <= 1.0:
        raise ValueError(
            f"lr_min is a ratio of the peak lr and must be in [0, 1], got {lr_min}"
        )
    if decay_ratio is not None and not 0.0 <= decay_ratio <= 1.0:
        raise ValueError(f"decay_ratio must be in [0, 1] or None, got {decay_ratio}")
    decay_steps = resolve_decay_steps(
        total_steps=total_steps, warmup_steps=warmup_steps, decay_ratio=decay_ratio
    )
    if warmup_steps + decay_steps > total_steps:
        raise ValueError(
            f"warmup_steps ({warmup_steps}) + decay steps ({decay_steps}, from "
            f"decay_ratio={decay_ratio}) must be <= total_steps ({total_steps})"
        )


class WSDScheduler(LambdaLR):
    """The WSD schedule; its state holds the settings it was built with, which a load compares with its own.

    A load takes the step (``last_epoch``) from the state and keeps this run's peak lr and schedule,
    then sets the optimizer's lr to this schedule's for the next step: the optimizer's loaded state
    holds the lr the checkpoint's schedule gave it, and that step would otherwise still run at it.
    """

    def __init__(self, optimizer: Optimizer, factor: functools.partial[float], settings: ScheduleSettings) -> None:
        super().__init__(optimizer, factor)
        # An attribute, so LambdaLR's state_dict saves it with the step.
        self.schedule: ScheduleSettings = settings

    def settings(self) -> ScheduleSettings:
        return {**self.schedule, "optimizer.lr": _one_lr([float(lr) for lr in self.base_lrs])}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        saved_schedule: ScheduleSettings | None = state.pop("schedule", None)
        saved_base_lrs: list[float] = state.pop("base_lrs", self.base_lrs)
        saved_next_lr: list[float] = state.get("_last_lr", [])
        super().load_state_dict(state)
        next_lrs = [float(base) * fn(self.last_epoch) for base, fn in zip(self.base_lrs, self.lr_lambdas)]
        for group, lr in zip(self.optimizer.param_groups, next_lrs):
            group["lr"] = lr
        self._last_lr = list(next_lrs)
        saved = None if saved_schedule is None else {**saved_schedule, "optimizer.lr": _one_lr(saved_base_lrs)}
        line = resume_change_line(saved, self.settings(), self.last_epoch + 1, saved_next_lr, next_lrs)
        if line:
            logger.warning("%s", line)


def _one_lr(lrs: list[float]) -> float | str:
    """The peak lr of the param groups: one number when they share it (this project's optimizer has one group)."""
    return lrs[0] if len(set(lrs)) == 1 else ",".join(f"{lr:g}" for lr in lrs)


def _shown(value: float | int | str | None) -> str:
    if value is None:
        return "unset"
    return f"{value:g}" if isinstance(value, float) else str(value)


def resume_change_line(saved: ScheduleSettings | None, current: ScheduleSettings, next_step: int,
                       saved_next_lr: list[float], next_lr: list[float]) -> str | None:
    """The WARNING line of a resume whose schedule differs from the checkpoint's; None when it does not.

    ``saved`` is None for a checkpoint written before schedules were recorded: then only a different
    lr at ``next_step`` shows the change.
    """
    lr_moved = bool(saved_next_lr) and any(
        not math.isclose(a, b, rel_tol=1e-9) for a, b in zip(saved_next_lr, next_lr))
    lr_text = f"lr {_shown(_one_lr(next_lr))} at step {next_step}"
    if lr_moved:
        lr_text += f" where the checkpoint's gave {_shown(_one_lr(saved_next_lr))}"
    if saved is None:
        return (f"Resuming with another LR schedule than the checkpoint's (which does not record its settings); "
                f"this run's applies: {lr_text}") if lr_moved else None
    changes = [f"--{name} {_shown(saved.get(name))} -> {_shown(value)}"
               for name, value in current.items() if saved.get(name) != value]
    if not changes:
        return None
    return (f"Resuming with another LR schedule than the checkpoint's: {', '.join(changes)}; this run's applies: "
            f"{lr_text} (resume with the checkpoint's values to keep its schedule)")


def build_lr_scheduler(
    optimizer: Optimizer,
    *,
    warmup_steps: int,
    decay_ratio: float | None,
    decay_type: str,
    lr_min: float,
    total_steps: int,
) -> WSDScheduler:
    """Wrap ``optimizer`` in a WSD schedule; call ``.step()`` after each optimizer step."""
    validate_schedule(
        warmup_steps=warmup_steps,
        decay_ratio=decay_ratio,
        decay_type=decay_type,
        lr_min=lr_min,
        total_steps=total_steps,
    )
    decay_steps = resolve_decay_steps(
        total_steps=total_steps, warmup_steps=warmup_steps, decay_ratio=decay_ratio
    )
    # A partial (not a lambda or a callable object) so that LambdaLR's state_dict stores no
    # function of the schedule: on resume the schedule comes from the current config and only
    # the step from the checkpoint (the recorded settings are compared, never applied).
    factor = functools.partial(
        _factor_for_epoch,
        warmup_steps=warmup_steps,
        decay_steps=decay_steps,
        total_steps=total_steps,
        decay_type=decay_type,
        lr_min=lr_min,
    )
    settings: ScheduleSettings = {
        "training.steps": total_steps,
        "lr_scheduler.warmup_steps": warmup_steps,
        "lr_scheduler.decay_ratio": decay_ratio,
        "lr_scheduler.decay_type": decay_type,
        "lr_scheduler.lr_min": lr_min,
    }
    return WSDScheduler(optimizer, factor, settings)
