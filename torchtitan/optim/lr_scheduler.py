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
"""

import functools
import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

DECAY_TYPES = ("linear", "cosine", "sqrt")


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


def build_lr_scheduler(
    optimizer: Optimizer,
    *,
    warmup_steps: int,
    decay_ratio: float | None,
    decay_type: str,
    lr_min: float,
    total_steps: int,
) -> LambdaLR:
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
    # A partial (not a lambda or a callable object) so that LambdaLR's
    # state_dict stores nothing of the schedule itself: on resume the schedule
    # comes from the current config and only last_epoch from the checkpoint.
    factor = functools.partial(
        _factor_for_epoch,
        warmup_steps=warmup_steps,
        decay_steps=decay_steps,
        total_steps=total_steps,
        decay_type=decay_type,
        lr_min=lr_min,
    )
    return LambdaLR(optimizer, factor)
