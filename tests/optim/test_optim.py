import json
import logging
import math
from types import SimpleNamespace

import pytest
import torch

from torchtitan.checkpoint.states import BUILTIN
from torchtitan.optim import build_lr_scheduler, build_optimizer, lr_factor
from torchtitan.optim.lr_scheduler import resolve_decay_steps

PEAK_LR = 1e-3
SCHEDULE_SPEC = next(spec for spec in BUILTIN if spec.name == "lr_scheduler")


def _optimizer(name: str = "AdamW", lr: float = PEAK_LR) -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(torch.ones(4))]
    return build_optimizer(
        params,
        name=name,
        lr=lr,
        eps=1e-8,
        weight_decay=0.1,
        betas=(0.9, 0.95),
        device_type="cpu",
    )


def _lrs(total_steps: int, **schedule) -> list[float]:
    """The lr used at training steps 1..total_steps, as the trainer sees it."""
    optimizer = _optimizer()
    scheduler = build_lr_scheduler(optimizer, total_steps=total_steps, **schedule)
    lrs = []
    for _ in range(total_steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


# --- schedule -------------------------------------------------------------


def test_warmup_starts_above_zero_and_reaches_peak():
    lrs = _lrs(20, warmup_steps=4, decay_ratio=0.5, decay_type="linear", lr_min=0.0)
    assert lrs[0] == pytest.approx(PEAK_LR / 5)
    assert lrs[0] > 0
    assert lrs[:5] == sorted(lrs[:5])
    assert lrs[4] == pytest.approx(PEAK_LR)


def test_zero_warmup_starts_at_peak():
    lrs = _lrs(10, warmup_steps=0, decay_ratio=0.5, decay_type="linear", lr_min=0.0)
    assert lrs[0] == pytest.approx(PEAK_LR)


def test_stable_phase_holds_peak():
    # warmup 1..2, stable 3..6, decay 7..10
    lrs = _lrs(10, warmup_steps=2, decay_ratio=0.4, decay_type="cosine", lr_min=0.1)
    assert lrs[2:6] == pytest.approx([PEAK_LR] * 4)
    assert lrs[6] < PEAK_LR


@pytest.mark.parametrize("decay_type", ["linear", "cosine", "sqrt"])
@pytest.mark.parametrize("decay_ratio", [0.3, None])
def test_decay_is_monotone_and_ends_at_lr_min(decay_type, decay_ratio):
    total, warmup, lr_min = 50, 5, 0.1
    lrs = _lrs(
        total, warmup_steps=warmup, decay_ratio=decay_ratio, decay_type=decay_type, lr_min=lr_min
    )
    after_warmup = lrs[warmup:]
    assert all(a >= b for a, b in zip(after_warmup, after_warmup[1:]))
    assert lrs[-2] > PEAK_LR * lr_min
    assert lrs[-1] == pytest.approx(PEAK_LR * lr_min, rel=1e-12)


@pytest.mark.parametrize("decay_type", ["linear", "cosine", "sqrt"])
def test_factor_is_exactly_lr_min_at_last_step(decay_type):
    kwargs = dict(warmup_steps=3, decay_steps=7, total_steps=20, decay_type=decay_type)
    assert lr_factor(20, lr_min=0.25, **kwargs) == 0.25
    assert lr_factor(20, lr_min=0.0, **kwargs) == 0.0
    # Past the end the lr stays at the floor.
    assert lr_factor(25, lr_min=0.25, **kwargs) == 0.25


def test_decay_curve_midpoints():
    kwargs = dict(warmup_steps=0, decay_steps=4, total_steps=4, lr_min=0.0)
    assert lr_factor(2, decay_type="linear", **kwargs) == pytest.approx(0.5)
    assert lr_factor(2, decay_type="cosine", **kwargs) == pytest.approx(0.5)
    assert lr_factor(2, decay_type="sqrt", **kwargs) == pytest.approx(1 - math.sqrt(0.5))
    assert lr_factor(1, decay_type="sqrt", **kwargs) == pytest.approx(0.5)


def test_zero_decay_ratio_keeps_peak_to_the_end():
    lrs = _lrs(8, warmup_steps=2, decay_ratio=0.0, decay_type="linear", lr_min=0.0)
    assert lrs[2:] == pytest.approx([PEAK_LR] * 6)


def test_decay_steps_rounding():
    assert resolve_decay_steps(total_steps=100, warmup_steps=0, decay_ratio=0.29) == 29
    assert resolve_decay_steps(total_steps=100, warmup_steps=10, decay_ratio=None) == 90


def test_scheduler_state_dict_holds_no_schedule_function():
    # On resume the schedule must come from the config, not the checkpoint: the state holds the
    # step and the settings (compared on load, never applied), no function.
    optimizer = _optimizer()
    scheduler = build_lr_scheduler(
        optimizer, warmup_steps=2, decay_ratio=None, decay_type="linear", lr_min=0.0, total_steps=10
    )
    optimizer.step()
    scheduler.step()
    state = scheduler.state_dict()
    assert state["last_epoch"] == 1
    assert state["lr_lambdas"] == [{}]
    assert state["schedule"]["training.steps"] == 10


# --- resume ---------------------------------------------------------------

DEBUG_SCHEDULE = dict(warmup_steps=2, decay_ratio=None, decay_type="linear", lr_min=0.1)


def _checkpointed_schedule(steps: int, total_steps: int, lr: float = 8e-4) -> str:
    """The LR schedule's checkpoint value (through its checkpoint state spec) after ``steps`` steps."""
    optimizer = _optimizer(lr=lr)
    scheduler = build_lr_scheduler(optimizer, total_steps=total_steps, **DEBUG_SCHEDULE)
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
    return SCHEDULE_SPEC.save(SimpleNamespace(lr_scheduler=scheduler), steps)


def _resumed_lrs(saved: str, total_steps: int, lr: float, steps: int) -> list[float]:
    """The lrs of the ``steps`` steps after loading ``saved`` into a run of this schedule (the optimizer's
    loaded state holds the lr the checkpoint's schedule set, as a real resume's does)."""
    optimizer = _optimizer(lr=lr)
    scheduler = build_lr_scheduler(optimizer, total_steps=total_steps, **DEBUG_SCHEDULE)
    optimizer.param_groups[0]["lr"] = json.loads(saved)["_last_lr"][0]
    SCHEDULE_SPEC.apply(SimpleNamespace(lr_scheduler=scheduler), saved)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_resume_with_the_same_schedule_is_silent_and_continues_it(caplog):
    uninterrupted = [lr * 8e-4 / PEAK_LR for lr in _lrs(10, **DEBUG_SCHEDULE)]
    with caplog.at_level(logging.WARNING):
        resumed = _resumed_lrs(_checkpointed_schedule(4, 10), total_steps=10, lr=8e-4, steps=6)
    assert resumed == pytest.approx(uninterrupted[4:], rel=1e-12)
    assert _warnings(caplog) == []


def test_resume_with_another_schedule_warns_once_and_applies_it_from_the_next_step(caplog):
    # Issue 60: steps 10 -> 20 ran step 11 at the old schedule's 8e-5, step 12 at the new one's 4e-4,
    # and a new --optimizer.lr was ignored (the checkpoint's base lr was kept), all without a word.
    with caplog.at_level(logging.WARNING):
        resumed = _resumed_lrs(_checkpointed_schedule(10, 10), total_steps=20, lr=4e-4, steps=3)
    fresh = [lr * 4e-4 / PEAK_LR for lr in _lrs(20, **DEBUG_SCHEDULE)]
    assert resumed == pytest.approx(fresh[10:13], rel=1e-12)
    [line] = _warnings(caplog)
    assert "--training.steps 10 -> 20" in line and "--optimizer.lr 0.0008 -> 0.0004" in line, line
    assert "lr 0.00022 at step 11 where the checkpoint's gave 8e-05" in line, line
    assert "warmup_steps" not in line and "\n" not in line, line


def test_resume_of_a_checkpoint_without_recorded_settings_warns_when_the_lr_moves(caplog):
    saved = json.loads(_checkpointed_schedule(10, 10))
    del saved["schedule"]  # as written before the settings were recorded
    with caplog.at_level(logging.WARNING):
        _resumed_lrs(json.dumps(saved), total_steps=10, lr=8e-4, steps=1)
        assert _warnings(caplog) == []
        _resumed_lrs(json.dumps(saved), total_steps=20, lr=8e-4, steps=1)
    [line] = _warnings(caplog)
    assert "does not record its settings" in line and "lr 0.00044 at step 11 where the checkpoint's gave 8e-05" in line


# --- validation -----------------------------------------------------------


def _build(**overrides):
    schedule = dict(
        warmup_steps=2, decay_ratio=0.5, decay_type="linear", lr_min=0.0, total_steps=10
    )
    schedule.update(overrides)
    return build_lr_scheduler(_optimizer(), **schedule)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(warmup_steps=-1), "warmup_steps"),
        (dict(decay_type="exp"), "decay_type"),
        (dict(lr_min=-0.1), "lr_min"),
        (dict(lr_min=1.5), "lr_min"),
        (dict(decay_ratio=-0.1), "decay_ratio"),
        (dict(decay_ratio=1.1), "decay_ratio"),
        (dict(total_steps=0), "total_steps"),
    ],
)
def test_invalid_schedule_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        _build(**overrides)


def test_warmup_plus_decay_too_long_reports_numbers():
    with pytest.raises(ValueError) as excinfo:
        _build(warmup_steps=6, decay_ratio=0.5, total_steps=10)
    message = str(excinfo.value)
    for part in ("warmup_steps (6)", "(5", "total_steps (10)"):
        assert part in message


def test_warmup_longer_than_training_is_rejected():
    with pytest.raises(ValueError, match="warmup_steps"):
        _build(warmup_steps=11, decay_ratio=None, total_steps=10)


# --- optimizer ------------------------------------------------------------


@pytest.mark.parametrize("name, cls", [("AdamW", torch.optim.AdamW), ("Adam", torch.optim.Adam)])
def test_optimizer_choice(name, cls):
    optimizer = _optimizer(name)
    assert type(optimizer) is cls
    group = optimizer.param_groups[0]
    assert group["lr"] == PEAK_LR
    assert group["betas"] == (0.9, 0.95)
    assert group["weight_decay"] == 0.1
    assert group["fused"] is True  # torch has a fused CPU kernel for float32
    assert not group["foreach"]


def test_foreach_where_no_fused_kernel_fits():
    """A device without fused kernels, or a dtype they do not take, keeps foreach."""
    for params, device_type in (([torch.nn.Parameter(torch.zeros(3))], "meta"),
                                ([torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))], "cpu")):
        group = build_optimizer(params, name="AdamW", lr=1e-3, eps=1e-8, weight_decay=0.0, betas=(0.9, 0.95),
                                device_type=device_type).param_groups[0]
        assert group["foreach"] is True and not group["fused"], (device_type, params[0].dtype)


def test_fused_and_foreach_agree_to_rounding():
    """The fused step is the same update as foreach: equal to float32 rounding after 5 steps."""
    torch.manual_seed(0)
    start = [torch.randn(64, 32), torch.randn(32)]
    grads = [[torch.randn_like(t) for t in start] for _ in range(5)]
    results = {}
    for impl in ("fused", "foreach"):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        optimizer = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, **{impl: True})
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            optimizer.step()
        results[impl] = params
    built = build_optimizer([torch.nn.Parameter(start[0].clone())], name="AdamW", lr=1e-2, eps=1e-8,
                            weight_decay=0.1, betas=(0.9, 0.95), device_type="cpu")
    assert built.param_groups[0]["fused"] is True
    for a, b in zip(results["fused"], results["foreach"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["adamw", "SGD", ""])
def test_unknown_optimizer_lists_choices(name):
    with pytest.raises(ValueError, match=r"Adam, AdamW"):
        _optimizer(name)


def test_one_step_changes_params():
    model = torch.nn.Linear(4, 2)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = build_optimizer(
        model.parameters(),
        name="AdamW",
        lr=1e-2,
        eps=1e-8,
        weight_decay=0.0,
        betas=(0.9, 0.95),
        device_type="cpu",
    )
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    for old, new in zip(before, model.parameters()):
        assert not torch.equal(old, new.detach())
