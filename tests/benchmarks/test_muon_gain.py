"""benchmarks/muon_gain.py's arithmetic: the held-out curve it reads from the trainer's own lines, the tokens
to reach a loss, and the ratio it reports (the training runs themselves are benchmarks/README.md §34's)."""

from __future__ import annotations

import pytest
from script_smoke import call_main, load

from torchtitan.metrics.logger import format_validation_line

gain_script = load("benchmarks/muon_gain.py")


def _run(optimizer: str, lr: float, curve: list[tuple[int, float]]) -> dict:
    return {"optimizer": optimizer, "lr": lr, "steps": len(curve), "curve": curve, "final": curve[-1][1],
            "seconds": 1.0}


def test_read_curve_takes_rank_0s_validation_lines_as_the_trainer_prints_them():
    lines = [f"[rank{rank}] 12:00:00 INFO " + format_validation_line(step, loss, 1.0, 640, 10, step * 64)
             for step, loss, rank in ((25, 7.65713, 0), (25, 9.0, 1), (50, 7.3775, 0))]
    lines.insert(1, "[rank0] 12:00:00 INFO step: 25  loss: 7.1")
    assert gain_script.read_curve("\n".join(lines)) == [(1600, 7.6571), (3200, 7.3775)]


@pytest.mark.parametrize("target, expected", [
    (6.5, 150.0),   # halfway between the evaluations at 100 and 200 tokens
    (6.2, 180.0),   # the first crossing, not the second one after the rise at 300 (325)
    (7.5, 100.0),   # below the target at the first evaluation already: that evaluation's tokens
    (4.0, None),    # never reached
])
def test_tokens_to_reach_interpolates_the_first_crossing(target, expected):
    curve = [(100, 7.0), (200, 6.0), (300, 6.3), (400, 5.9), (500, 5.0)]
    reached = gain_script.tokens_to_reach(curve, target)
    assert reached == (None if expected is None else pytest.approx(expected))


def test_gain_picks_each_best_lr_by_final_loss_and_bounds_a_curve_that_never_gets_there():
    muon = [_run("Muon", 1e-3, [(100, 6.0), (200, 5.0)]), _run("Muon", 3e-3, [(100, 6.0), (200, 5.5)])]
    adamw = [_run("AdamW", 1e-3, [(100, 6.5), (200, 5.8)]), _run("AdamW", 3e-3, [(100, 6.4), (200, 5.2)])]
    never = gain_script.gain(adamw + muon, 2)
    assert (never["best_adamw_lr"], never["best_muon_lr"], never["target"]) == (3e-3, 1e-3, 5.0)
    assert never["ratio"] is None and never["ratio_above"] == 1.0
    # A longer AdamW run at its best lr reaches 5.0 at 300 tokens: 1.5x Muon's 200.
    longer = _run("AdamW", 3e-3, [(100, 6.4), (200, 5.2), (300, 5.0), (400, 4.9)])
    found = gain_script.gain(adamw + muon + [longer], 2)
    assert (found["adamw_tokens"], found["ratio"], found["adamw_steps_searched"]) == (300.0, 1.5, 4)


@pytest.mark.parametrize("argv, expected", [
    (["--lrs-muon", "1e-3,0"], "--lrs-muon: '1e-3,0' is not a comma-separated list of positive learning rates"),
    (["--steps", "300", "--extend-steps", "200"], "--extend-steps 200: must exceed --steps 300"),
])
def test_a_bad_argument_is_refused_in_one_line(argv, expected, capsys):
    assert call_main(gain_script, argv) == 2
    assert expected in capsys.readouterr().err
