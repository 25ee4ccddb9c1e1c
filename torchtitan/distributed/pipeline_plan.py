"""The pipeline's plan: how many stages, which layers each holds, how many microbatches.

``PipelinePlan.from_config`` works it out from the config alone (its [parallelism], the local batch and
compile of [training], and [activation_checkpoint]), with every check that
the schedule accepts it, so preflight can report the problems before any process group
exists. ``pipeline_parallel.py`` builds and runs the stages the plan describes.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math

import torch

from torchtitan.config import ConfigError
from torchtitan.config.job_config import ActivationCheckpoint, Parallelism, Training
from torchtitan.distributed.activation_checkpoint import is_per_op

# Our schedule name -> the class name in torch.distributed.pipelining.schedules.
SCHEDULE_CLASS_NAMES = {
    "GPipe": "ScheduleGPipe",
    "1F1B": "Schedule1F1B",
    "Interleaved1F1B": "ScheduleInterleaved1F1B",
    "LoopedBFS": "ScheduleLoopedBFS",
    "InterleavedZeroBubble": "ScheduleInterleavedZeroBubble",
    "ZBVZeroBubble": "ScheduleZBVZeroBubble",
    "DualPipeV": "ScheduleDualPipeV",
}


@functools.cache
def schedules() -> dict[str, type]:
    """Our schedule name -> its class, for the schedules the installed torch provides.

    Imported on first use: torch's pipelining imports its compiler stack (about a second of CPU), which the
    launcher's preflight, a process of its own before torchrun, has no other use for.
    """
    from torch.distributed.pipelining import schedules as torch_schedules

    return {name: getattr(torch_schedules, cls) for name, cls in SCHEDULE_CLASS_NAMES.items()
            if hasattr(torch_schedules, cls)}


SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
# These split backward into input and weight passes, which torch does not support on compiled modules.
# DualPipeV pairs one micro-batch's forward with another's backward (OVERLAP_F_B); torch's runtime runs the pair
# one after the other (OVERLAPPED_IN_SEQUENCE_NOTE).
ZERO_BUBBLE_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
V_SHAPED_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
DEFAULT_STAGES_PER_RANK = 2
OVERLAPPED_IN_SEQUENCE_NOTE = (
    "DualPipeV: each overlapped pair (one micro-batch's forward with another's backward) runs as the forward, then "
    "the backward; the schedule's order is DualPipeV's, but no pair's compute runs while the other's all-to-all "
    "travels (docs/parallelism.md)")

_PP = "--parallelism.pipeline_parallel_"
logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """The stage layout of a pipeline, worked out from the config alone."""

    schedule: str  # canonical name, a key of schedules()
    pp: int  # pipeline ranks
    microbatches: int  # per local batch
    layer_starts: tuple[int, ...]  # stage s holds layers [layer_starts[s], layer_starts[s + 1])

    @classmethod
    def from_config(cls, p: Parallelism, t: Training, ac: ActivationCheckpoint, n_layers: int) -> PipelinePlan:
        """The plan for these sections and a model of ``n_layers``; ``ConfigError`` lists every problem with it."""
        schedule = _schedule(p.pipeline_parallel_schedule)
        starts, problems = _layer_starts(p, n_layers, schedule in SINGLE_STAGE_SCHEDULES)
        pp = p.pipeline_parallel_degree
        stages_per_rank = (len(starts) - 1) // pp
        problems += _stages_per_rank_problems(schedule, stages_per_rank)
        microbatches = p.pipeline_parallel_microbatches or len(starts) - 1
        problems += _microbatch_problems(p, t.batch_size, schedule, microbatches, len(starts) - 1)
        problems += _backward_problems(t, ac, schedule)
        if problems:
            raise ConfigError(problems)
        recompute = zero_bubble_recompute_note(schedule, ac)
        if recompute:
            logger.warning(recompute)
        return cls(schedule=schedule, pp=pp, microbatches=microbatches, layer_starts=starts)

    @property
    def num_stages(self) -> int:
        return len(self.layer_starts) - 1

    @property
    def stages_per_rank(self) -> int:
        return self.num_stages // self.pp

    @property
    def v_shaped(self) -> bool:
        return self.schedule in V_SHAPED_SCHEDULES

    def stage_ids(self, pp_rank: int) -> list[int]:
        """The stages pp rank ``pp_rank`` holds, in ascending order."""
        if self.v_shaped:
            return sorted({pp_rank, self.num_stages - 1 - pp_rank})
        return list(range(pp_rank, self.num_stages, self.pp))

    def stage_owner(self, stage_id: int) -> int:
        """The pp rank that holds stage ``stage_id``."""
        if self.v_shaped:
            return stage_id if stage_id < self.pp else self.num_stages - 1 - stage_id
        return stage_id % self.pp

    def describe(self) -> str:
        parts = []
        for s in range(self.num_stages):
            lo, hi = self.layer_starts[s], self.layer_starts[s + 1]
            held = ["embedding"] if s == 0 else []
            held += [f"layers {lo}-{hi - 1}" if hi - lo > 1 else f"layer {lo}"] if hi > lo else []
            held += ["norm+output"] if s == self.num_stages - 1 else []
            parts.append(f"stage {s}: {', '.join(held)}")
        return "; ".join(parts)


def even_layer_starts(n_layers: int, num_stages: int, embed_weight: int, output_weight: int) -> tuple[int, ...]:
    """Layer boundaries that balance (embedding weight + layers + output weight) over the stages.

    The embedding is pinned to the first stage and the output to the last; a weight
    makes those stages take correspondingly fewer layers.
    """
    total = n_layers + embed_weight + output_weight
    starts = [0]
    for s in range(1, num_stages):
        boundary = math.floor(s * total / num_stages + 0.5) - embed_weight  # round half up, deterministically
        starts.append(min(max(boundary, starts[-1]), n_layers))
    starts.append(n_layers)
    return tuple(starts)


# ---- the phases of from_config ----------------------------------------------
def _schedule(name: str) -> str:
    """The canonical schedule name (matched case-insensitively); an unknown one ends the check."""
    available = schedules()
    schedule = {n.lower(): n for n in available}.get(name.lower())
    if schedule is None:
        missing = [n for n in SCHEDULE_CLASS_NAMES if n not in available]
        note = f" ({', '.join(missing)} need a newer torch than {torch.__version__})" if missing else ""
        raise ConfigError([f"{_PP}schedule={name}: unknown; choose one of {', '.join(available)}{note}"])
    return schedule


def _layer_starts(p: Parallelism, n_layers: int, single: bool) -> tuple[tuple[int, ...], list[str]]:
    """Stage boundaries from the split points, or an even split; a layout that cannot exist ends the check."""
    problems: list[str] = []
    pp, v_flag = p.pipeline_parallel_degree, p.pipeline_parallel_stages_per_rank
    if p.pipeline_parallel_split_points:
        starts = _parse_split_points(p.pipeline_parallel_split_points, n_layers, problems)
        if problems:
            raise ConfigError(problems)
        num_stages = len(starts) - 1
        if num_stages % pp:
            raise ConfigError([
                f"{_PP}split_points: {len(starts) - 2} split points make {num_stages} stages, which do not divide "
                f"evenly over pipeline_parallel_degree={pp} ranks; give pp * stages_per_rank - 1 points"
            ])
        if v_flag is not None and v_flag != num_stages // pp:
            problems.append(f"{_PP}stages_per_rank={v_flag} contradicts the split points, which make "
                            f"{num_stages // pp} stage(s) per rank; leave stages_per_rank unset")
        return starts, problems
    v = v_flag if v_flag is not None else (1 if single else DEFAULT_STAGES_PER_RANK)
    num_stages = pp * v
    e, o = p.pipeline_parallel_embedding_weight, p.pipeline_parallel_output_weight
    if n_layers + e + o < num_stages:
        raise ConfigError([
            f"pipeline: {num_stages} stages ({pp} ranks x {v} per rank) but the model has only {n_layers} "
            f"layers{f' (+{e + o} for embedding/output weights)' if e or o else ''}; lower "
            f"pipeline_parallel_degree or stages_per_rank, or count the embedding/output as layers with "
            f"{_PP}embedding_weight / {_PP}output_weight"
        ])
    starts = even_layer_starts(n_layers, num_stages, e, o)
    empty = [s for s in range(1, num_stages - 1) if starts[s + 1] == starts[s]]
    if empty:
        problems.append(
            f"pipeline: an even split of {n_layers} layers over {num_stages} stages with embedding weight {e} and "
            f"output weight {o} leaves stage(s) {empty} without layers; lower the weights or give "
            f"{_PP}split_points"
        )
    return starts, problems


def _parse_split_points(points: list[str], n_layers: int, problems: list[str]) -> tuple[int, ...]:
    indices = []
    for point in points:
        prefix, _, index = point.partition(".")
        if prefix != "layers" or not index.isdigit() or not 0 <= int(index) < n_layers:
            problems.append(f"{_PP}split_points: '{point}' is not a layer FQN of this model; "
                            f"use layers.N with 0 <= N < {n_layers}")
            return ()
        indices.append(int(index))
    if any(b <= a for a, b in zip(indices, indices[1:])):
        problems.append(f"{_PP}split_points={','.join(points)}: list the layers in increasing order, each once "
                        "(every stage between two split points needs at least one layer)")
        return ()
    return (0, *indices, n_layers)


def _stages_per_rank_problems(schedule: str, v: int) -> list[str]:
    problems = []
    if schedule in SINGLE_STAGE_SCHEDULES and v != 1:
        problems.append(
            f"{_PP}schedule={schedule} runs one stage per rank, but the config asks for {v}; use one of "
            f"{', '.join(n for n in schedules() if n not in SINGLE_STAGE_SCHEDULES)} for several stages per rank"
        )
    if schedule not in SINGLE_STAGE_SCHEDULES and v < 2:
        problems.append(
            f"{_PP}schedule={schedule} is a multi-stage schedule and needs >= 2 stages per rank (got {v}); "
            f"use {' or '.join(SINGLE_STAGE_SCHEDULES)} for one stage per rank"
        )
    if schedule in V_SHAPED_SCHEDULES and v != 2:
        problems.append(f"{_PP}schedule={schedule} needs exactly 2 stages per rank (got {v}); set "
                        f"{_PP}stages_per_rank=2 or give pipeline_parallel_degree * 2 - 1 split points")
    return problems


def _microbatch_problems(p: Parallelism, batch: int, schedule: str, m: int, num_stages: int) -> list[str]:
    """``batch``: the local batch (--training.batch_size)."""
    problems, pp = [], p.pipeline_parallel_degree
    if batch % m:
        problems.append(
            f"pipeline: local batch --training.batch_size={batch} is not divisible by {m} microbatches"
            f"{'' if p.pipeline_parallel_microbatches else ' (the default: one per stage)'}; set "
            f"{_PP}microbatches to a divisor of the batch size or change the batch size"
        )
    if schedule in ("1F1B", "DualPipeV") and m < num_stages:
        problems.append(f"{_PP}schedule={schedule} needs at least as many microbatches as stages ({num_stages}); got "
                        f"{m}: set {_PP}microbatches to a divisor of --training.batch_size that is >= {num_stages}")
    if schedule not in SINGLE_STAGE_SCHEDULES:
        rounds = max(1, m // pp)
        if m < pp:
            problems.append(f"{_PP}schedule={schedule} needs at least pipeline_parallel_degree={pp} microbatches; "
                            f"got {m}")
        elif schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and m % rounds:
            problems.append(
                f"{_PP}schedule={schedule}: {m} microbatches is not a multiple of the number of rounds "
                f"({rounds} = microbatches // pipeline_parallel_degree); use a multiple of {pp}"
            )
    return problems


def zero_bubble_recompute_note(schedule: str, ac: ActivationCheckpoint) -> str | None:
    """The line a zero-bubble schedule with activation checkpointing logs: it trains, at a price worth saying.

    Its split backward recomputes the checkpointed blocks several times over, as the planner's dry run counts
    (benchmarks/README.md §37).
    """
    if schedule not in ZERO_BUBBLE_SCHEDULES or ac.mode == "none":
        return None
    return (f"{_PP}schedule={schedule} with --activation_checkpoint.mode={ac.mode}: the weight pass recomputes "
            "checkpointed blocks several times over (scripts/plan.py prices it); turn activation checkpointing off "
            "(--activation_checkpoint.mode=none) or use 1F1B or Interleaved1F1B")


def _backward_problems(t: Training, ac: ActivationCheckpoint, schedule: str) -> list[str]:
    """Zero-bubble schedules run backward in two passes, which some other options forbid."""
    if schedule not in ZERO_BUBBLE_SCHEDULES:
        return []
    problems: list[str] = []
    if t.compile:
        problems.append(
            f"{_PP}schedule={schedule} splits backward into input and weight passes, which torch does not support "
            "on compiled blocks; turn off --training.compile or choose another schedule"
        )
    if ac.mode == "selective" and is_per_op(ac.selective_ac_option):
        problems.append(
            f"{_PP}schedule={schedule} runs backward through each block twice (input, then weight gradients), "
            "which op-level selective activation checkpointing forbids; use --activation_checkpoint.mode=full, "
            "selective with a block interval (selective_ac_option=N), or another schedule"
        )
    return problems
