"""The pipeline bubble simulated from the schedules' own action lists (planning/pipeline_timeline.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

import pytest
import torch

from torchtitan.distributed.pipeline_plan import PipelinePlan
from torchtitan.planning.clusters import load_cluster
from torchtitan.planning.compute import PhaseWork
from torchtitan.planning.cost import _pipeline_phase_s, phase_compute_s
from torchtitan.planning.dry_run import DryRun
from torchtitan.planning.pipeline import _StandInStage, pipeline_bubble_s, planned_actions
from torchtitan.planning.pipeline_timeline import Action, StageTimes, action_lists, simulate

F, B = 1.0, 2.0  # one micro-batch's forward and backward on a rank, in seconds


def _plan(schedule: str, pp: int, v: int, m: int) -> PipelinePlan:
    return PipelinePlan(schedule=schedule, pp=pp, microbatches=m, layer_starts=tuple(range(pp * v + 1)))


def _equal_bubbles(plan: PipelinePlan) -> list[float]:
    """Every pp rank's bubble when each rank's stages together take F and B per micro-batch."""
    phase_s = {r: (F * plan.microbatches, B * plan.microbatches) for r in range(plan.pp)}
    return [pipeline_bubble_s(plan, phase_s, r) for r in range(plan.pp)]


def test_one_f_one_b_lists_the_order_its_step_runs() -> None:
    # Warm-up of (pp - rank) forwards, then a backward and a forward in turn, then the last backwards.
    listed = {r: [str(a) for a in acts] for r, acts in planned_actions(_plan("1F1B", 2, 1, 3)).items()}
    assert listed == {0: ["0F0", "0F1", "0B0", "0F2", "0B1", "0B2"], 1: ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2"]}


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
@pytest.mark.parametrize("pp", [2, 3, 4])
def test_single_stage_bubble_is_pp_minus_one_forward_backward(schedule: str, pp: int) -> None:
    assert _equal_bubbles(_plan(schedule, pp, 1, 2 * pp)) == pytest.approx([(pp - 1) * (F + B)] * pp)


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8)])
def test_interleaved_bubble_is_the_textbook_fraction(pp: int, m: int) -> None:
    # (pp - 1) / (v m) of the rank's compute m (F + B): each of the v = 2 stages takes half of F and B.
    assert _equal_bubbles(_plan("Interleaved1F1B", pp, 2, m)) == pytest.approx([(pp - 1) * (F + B) / 2] * pp)


@pytest.mark.parametrize("schedule", ["InterleavedZeroBubble", "ZBVZeroBubble"])
def test_zero_bubble_schedules_idle_less_than_1f1b(schedule: str) -> None:
    zero_bubble, one_f_one_b = _equal_bubbles(_plan(schedule, 4, 2, 8)), _equal_bubbles(_plan("1F1B", 4, 1, 8))
    # Weight gradients fill the warm-up and cool-down: only the forwards' ramp, (pp - 1) stage forwards, is left.
    assert zero_bubble == pytest.approx([3 * F / 2] * 4)
    assert max(zero_bubble) < min(one_f_one_b)


def test_dual_pipe_v_read_from_the_schedule_object_alone() -> None:
    from torch.distributed.pipelining import schedules as torch_schedules

    if not hasattr(torch_schedules, "ScheduleDualPipeV"):
        pytest.fail(f"torch {torch.__version__} has no ScheduleDualPipeV; list it in docs/versions.md")
    pp, m = 4, 8
    stages = [_StandInStage(s, 2 * pp, pp, 0) for s in (0, 2 * pp - 1)]
    dual_pipe_v: type = torch_schedules.ScheduleDualPipeV  # built on stand-ins as planned_actions builds its own
    actions = action_lists(dual_pipe_v(stages, n_microbatches=m, scale_grads=False))
    assert any(a.parts for acts in actions.values() for a in acts), "DualPipeV overlaps a forward with a backward"
    timeline = simulate(actions, {s: StageTimes(F / 2, B / 2) for s in range(2 * pp)})
    # An overlapped forward and backward take F + B on the GPU: every rank computes m (F + B) in all.
    assert timeline.busy_s == pytest.approx(dict.fromkeys(range(pp), m * (F + B)))
    assert max(timeline.bubble_s(r) for r in range(pp)) < min(_equal_bubbles(_plan("1F1B", pp, 1, m)))


def test_unequal_stages_gpipe_by_hand() -> None:
    # Stage 1 twice as slow. Rank 0: F0 [0,1] F1 [1,2]; rank 1: F0 [1,3] F1 [3,5] B0 [5,9] B1 [9,13];
    # rank 0: B0 [9,11] B1 [13,15]. Span 15: rank 0 idles 15 - 6, rank 1 15 - 12.
    timeline = simulate(planned_actions(_plan("GPipe", 2, 1, 2)), {0: StageTimes(1.0, 2.0), 1: StageTimes(2.0, 4.0)})
    assert timeline.makespan_s == 15.0
    assert (timeline.bubble_s(0), timeline.bubble_s(1)) == (9.0, 3.0)


def test_slowest_stage_sets_the_pace() -> None:
    # 1F1B, pp 4, m 8, stage 2 twice as slow. It starts after stages 0 and 1 forward (2F = 2), idles 1 after
    # its second forward (2) for stage 3's F + B (3), then runs its 8 (2F + 2B) = 48 back to back; stages 1
    # and 0 then backward once each (2B = 4): span 55, and every fast rank idles 55 - 8 (F + B).
    plan, m = _plan("1F1B", 4, 1, 8), 8
    phase_s = {r: (F * m, B * m) for r in range(4)} | {2: (2 * F * m, 2 * B * m)}
    bubbles = [pipeline_bubble_s(plan, phase_s, r) for r in range(4)]
    assert bubbles == pytest.approx([55 - 24, 55 - 24, 55 - 48, 55 - 24])


def test_a_rank_not_simulated_runs_as_the_priced_one() -> None:
    plan, m = _plan("1F1B", 4, 1, 8), 8
    only_first = {0: (F * m, B * m)}
    assert pipeline_bubble_s(plan, only_first, 0) == pytest.approx(3 * (F + B))


def test_weight_backward_waits_for_its_input_backward() -> None:
    # One stage, W listed before I: W cannot run, and the rank's next action never starts.
    with pytest.raises(ValueError, match=r"deadlocks.*0W0"):
        simulate({0: [Action("F", 0, 0), Action("W", 0, 0), Action("I", 0, 0)]}, {0: StageTimes(F, B)})


def test_cost_prices_each_pp_rank_from_the_simulated_rank_that_stands_for_it() -> None:
    # The dry run simulated pp ranks 0 and 2 (2 stands for 1 and 2, twice as slow as 0; 3 not simulated).
    cluster = load_cluster("h100-sxm-80g")
    fast, slow = PhaseWork(matmul_flops=10**12), PhaseWork(matmul_flops=2 * 10**12)
    ranks = [SimpleNamespace(coords={"pp": 0}, stands_for=[0], work={"forward": fast, "backward": fast}),
             SimpleNamespace(coords={"pp": 2}, stands_for=[1, 2], work={"forward": slow, "backward": slow})]
    phase_s = _pipeline_phase_s(cast(DryRun, SimpleNamespace(ranks=ranks)), cluster)
    one, two = phase_compute_s(fast, cluster), phase_compute_s(slow, cluster)
    assert phase_s == {0: (one, one), 1: (two, two), 2: (two, two)}
    plan = _plan("1F1B", 4, 1, 8)
    # Rank 0 waits for the slow ranks 1 and 2; rank 3 runs as the priced rank does.
    assert pipeline_bubble_s(plan, phase_s, 0) > pipeline_bubble_s(plan, {r: phase_s[0] for r in range(4)}, 0)
