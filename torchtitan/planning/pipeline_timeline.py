"""The pipeline bubble from the schedule's own action lists: each rank's actions simulated in order.

``action_lists`` reads a pipeline schedule object (torch's) as every pp rank's compute actions in the
order that rank runs them: forward (F), full backward (B), input backward (I), weight backward (W), and
a forward overlapped with a backward (the two run as one action). Multi-stage schedules list them in
their ``pipeline_order``; the single-stage ones (GPipe, 1F1B) are expanded here by the order their
step runs them (torch's own listing of 1F1B does not follow its step's order).

``simulate`` runs those lists against per-stage durations of one micro-batch's forward, input backward
and weight backward. A rank runs its actions one at a time, in its list's order, each as soon as the
previous one is done and its inputs are there:
- F of stage s, micro-batch m after F of stage s-1, m;
- B or I of s, m after F of s, m and after B or I of s+1, m (the gradient of its output);
- W of s, m after I of s, m.
An overlapped forward and backward run on the same GPU, so the action takes F + B: what it hides (the
other micro-batch's communication) is no compute, and the bubble counts compute only. Send/recv
latency is left out: the cost model counts pp traffic as exposed beyond the bubble (``cost.py``).

A rank's bubble is its idle time in the step: the last rank's finish minus its own busy time (every
rank waits for the slowest at the step's end: gradient clipping's norm spans the pipeline).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from torchtitan.compat.errors import missing

# Assumption: the weight-gradient share of a backward, used where a schedule splits the backward into
# I and W. The dry run's ledger records one backward phase and cannot tell the two apart; each is one
# matmul per weight of the forward's size (dX = dY W, dW = X^T dY), so they are taken equal.
WEIGHT_GRAD_SHARE = 0.5

FORWARD, BACKWARD, INPUT_BACKWARD, WEIGHT_BACKWARD, OVERLAPPED = "F", "B", "I", "W", "OVERLAP_F_B"
_KINDS = (FORWARD, BACKWARD, INPUT_BACKWARD, WEIGHT_BACKWARD, OVERLAPPED)


@dataclass(frozen=True)
class StageTimes:
    """One micro-batch's compute on one stage, in seconds."""

    forward_s: float
    backward_s: float  # input and weight gradients together
    weight_share: float = WEIGHT_GRAD_SHARE

    def seconds(self, kind: str) -> float:
        if kind == FORWARD:
            return self.forward_s
        if kind == INPUT_BACKWARD:
            return self.backward_s * (1.0 - self.weight_share)
        if kind == WEIGHT_BACKWARD:
            return self.backward_s * self.weight_share
        return self.backward_s


@dataclass(frozen=True)
class Action:
    """One compute action of a rank: ``kind`` of ``stage`` on ``microbatch``; an overlapped one holds its
    forward and backward in ``parts`` (its own stage and micro-batch are its first part's)."""

    kind: str
    stage: int
    microbatch: int
    parts: tuple[Action, ...] = ()

    def __str__(self) -> str:
        if self.parts:
            return "(" + ";".join(str(p) for p in self.parts) + ")"
        return f"{self.stage}{self.kind}{self.microbatch}"


@dataclass(frozen=True)
class Timeline:
    """What ``simulate`` found: each rank's compute time and the time its last action ends."""

    busy_s: dict[int, float] = field(default_factory=dict)
    finish_s: dict[int, float] = field(default_factory=dict)

    @property
    def makespan_s(self) -> float:
        return max(self.finish_s.values(), default=0.0)

    def bubble_s(self, rank: int) -> float:
        """``rank``'s idle time in the step: the pipeline's span less its own compute."""
        return self.makespan_s - self.busy_s.get(rank, 0.0)


def action_lists(schedule: object) -> dict[int, list[Action]]:
    """Every pp rank's compute actions in its order, read from a torch pipeline ``schedule``."""
    from torch.distributed.pipelining import schedules as torch_schedules

    if isinstance(schedule, torch_schedules.PipelineScheduleSingle):
        stages, microbatches = _single_stage_shape(schedule)
        expand = _gpipe if isinstance(schedule, torch_schedules.ScheduleGPipe) else _one_f_one_b
        return {rank: expand(rank, stages, microbatches) for rank in range(stages)}
    order = getattr(schedule, "pipeline_order", None)
    if not isinstance(order, dict):
        raise missing(f"{type(schedule).__name__}.pipeline_order")
    return {rank: [a for a in map(_action, actions) if a is not None] for rank, actions in order.items()}


def _single_stage_shape(schedule: object) -> tuple[int, int]:
    stages, microbatches = getattr(schedule, "_num_stages", None), getattr(schedule, "_n_microbatches", None)
    if not isinstance(stages, int) or not isinstance(microbatches, int):
        raise missing(f"{type(schedule).__name__}._num_stages / _n_microbatches")
    return stages, microbatches


def _gpipe(rank: int, stages: int, microbatches: int) -> list[Action]:
    """Every forward, then every backward, in micro-batch order."""
    return ([Action(FORWARD, rank, m) for m in range(microbatches)]
            + [Action(BACKWARD, rank, m) for m in range(microbatches)])


def _one_f_one_b(rank: int, stages: int, microbatches: int) -> list[Action]:
    """1F1B as its step runs: ``stages - rank`` forwards (at most every micro-batch), then a backward and a
    forward in turn while forwards remain, then the remaining backwards."""
    warmup = min(microbatches, stages - rank)
    actions = [Action(FORWARD, rank, m) for m in range(warmup)]
    for m in range(microbatches):
        actions.append(Action(BACKWARD, rank, m))
        if warmup + m < microbatches:
            actions.append(Action(FORWARD, rank, warmup + m))
    return actions


class _TorchAction(Protocol):
    """What is read of an action in a torch schedule's ``pipeline_order``."""

    computation_type: Enum
    stage_index: int
    microbatch_index: int | None
    sub_actions: tuple[_TorchAction, ...] | None


def _action(torch_action: _TorchAction | None) -> Action | None:
    """A torch schedule action as an ``Action``; None for what is no compute (None, sends, resharding)."""
    if torch_action is None or torch_action.computation_type.value not in _KINDS:
        return None
    kind = torch_action.computation_type.value
    if kind != OVERLAPPED:
        return Action(kind, torch_action.stage_index, torch_action.microbatch_index or 0)
    parts = tuple(a for a in map(_action, torch_action.sub_actions or ()) if a is not None)
    if not parts:
        raise missing(f"sub_actions of the overlapped action {torch_action}")
    return Action(kind, parts[0].stage, parts[0].microbatch, parts)


def simulate(actions: Mapping[int, list[Action]], times: Mapping[int, StageTimes]) -> Timeline:
    """Each rank's ``actions`` run in order with ``times[stage]`` (module docstring: what waits on what).

    A ``ValueError`` names the ranks whose next action can never start (a schedule that deadlocks)."""
    last_stage = max((p.stage for acts in actions.values() for a in acts for p in (a.parts or (a,))), default=0)
    done: dict[tuple[str, int, int], float] = {}
    next_index = dict.fromkeys(actions, 0)
    timeline = Timeline(busy_s=dict.fromkeys(actions, 0.0), finish_s=dict.fromkeys(actions, 0.0))
    progressed = True
    while progressed:
        progressed = False
        for rank, acts in actions.items():
            while next_index[rank] < len(acts):
                action = acts[next_index[rank]]
                parts = action.parts or (action,)
                needs = [done.get(d) for p in parts for d in _inputs(p, last_stage)]
                if any(t is None for t in needs):
                    break
                start = max([timeline.finish_s[rank], *(t for t in needs if t is not None)])
                duration = sum(times[p.stage].seconds(p.kind) for p in parts)
                timeline.finish_s[rank] = start + duration
                timeline.busy_s[rank] += duration
                for p in parts:
                    for key in _outputs(p):
                        done[key] = start + duration
                next_index[rank] += 1
                progressed = True
    stuck = {rank: str(acts[next_index[rank]]) for rank, acts in actions.items() if next_index[rank] < len(acts)}
    if stuck:
        raise ValueError(f"pipeline schedule deadlocks: the next action of each pp rank {stuck} waits on one "
                         "that never runs; the schedule's action lists are inconsistent")
    return timeline


def _inputs(a: Action, last_stage: int) -> list[tuple[str, int, int]]:
    """What ``a`` waits for, as (F, stage, micro-batch) or (I: input gradient done, stage, micro-batch)."""
    if a.kind == FORWARD:
        return [(FORWARD, a.stage - 1, a.microbatch)] if a.stage > 0 else []
    if a.kind == WEIGHT_BACKWARD:
        return [(INPUT_BACKWARD, a.stage, a.microbatch)]
    later = [(INPUT_BACKWARD, a.stage + 1, a.microbatch)] if a.stage < last_stage else []
    return [(FORWARD, a.stage, a.microbatch), *later]


def _outputs(a: Action) -> list[tuple[str, int, int]]:
    if a.kind == FORWARD:
        return [(FORWARD, a.stage, a.microbatch)]
    if a.kind == BACKWARD:
        return [(INPUT_BACKWARD, a.stage, a.microbatch), (WEIGHT_BACKWARD, a.stage, a.microbatch)]
    return [(a.kind, a.stage, a.microbatch)]
