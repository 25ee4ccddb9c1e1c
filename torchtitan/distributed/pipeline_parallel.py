"""Pipeline parallelism: split the model into stages by layers and run them with a pipeline schedule.

Three parts, each usable on its own:

- ``plan_pipeline`` works out, from the config alone, how many stages there are,
  which layers each holds, how many microbatches a local batch is cut into and
  whether the schedule accepts all of that. It raises ``ConfigError`` (one line per
  problem) and touches no process group, so ``preflight`` can call it on every rank.
- ``prune_to_stage`` turns a copy of the whole (meta-device) model into one stage.
  The stage is still a ``Transformer``: the layers it does not own are dropped from
  the ``layers`` ModuleDict (keyed by original index) and the embedding, final norm
  and output projection become None where they belong to another stage. Parameter
  FQNs therefore stay those of the whole model, which the layout-invariant init and
  checkpoints key on.
- ``build_pipeline`` prunes, parallelizes and initializes this rank's stages (through
  a caller-supplied ``materialize``), wraps each in a ``PipelineStage`` and builds the
  schedule; ``PipelineRunner.step`` then runs one local batch through it, and
  ``PipelineRunner.forward_only`` runs one through the stages without the schedule
  (validation).

Placement: stage ``s`` of ``S = pp * v`` lives on pp rank ``s % pp`` ("looped"), so
rank ``r`` holds stages ``r, r + pp, ...``. ZBVZeroBubble needs the V shape instead:
rank ``r`` holds stages ``r`` and ``2 * pp - 1 - r``.

Loss and gradients: the last stage computes the trainer's loss (a sum of token
losses) times the step's normalisation, exactly the quantity the non-pipelined step
back-propagates, and the schedule is told not to rescale gradients. The pipelining
runtime switches off FSDP's gradient sync during the microbatch backwards and
reduces once per schedule step.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.tensor import DTensor

from torchtitan.config import ConfigError, JobConfig

# Our schedule name -> the class name in torch.distributed.pipelining.schedules.
_SCHEDULE_CLASS_NAMES = {
    "GPipe": "ScheduleGPipe",
    "1F1B": "Schedule1F1B",
    "Interleaved1F1B": "ScheduleInterleaved1F1B",
    "LoopedBFS": "ScheduleLoopedBFS",
    "InterleavedZeroBubble": "ScheduleInterleavedZeroBubble",
    "ZBVZeroBubble": "ScheduleZBVZeroBubble",
}
# Only what the installed torch provides is offered.
SCHEDULES: dict[str, type] = {
    name: getattr(torch_schedules, cls) for name, cls in _SCHEDULE_CLASS_NAMES.items() if hasattr(torch_schedules, cls)
}
SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
# These split backward into input and weight passes, which torch does not support on compiled modules.
ZERO_BUBBLE_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble")
V_SHAPED_SCHEDULES = ("ZBVZeroBubble",)
DEFAULT_STAGES_PER_RANK = 2
_FLAG = "--parallelism.pipeline_parallel_"


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """The stage layout of a pipeline, worked out from the config alone."""

    schedule: str  # canonical name, a key of SCHEDULES
    pp: int  # pipeline ranks
    microbatches: int  # per local batch
    layer_starts: tuple[int, ...]  # stage s holds layers [layer_starts[s], layer_starts[s + 1])

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


def _resolve_schedule(name: str) -> str | None:
    """The canonical schedule name for ``name`` (case-insensitive), or None."""
    by_lower = {n.lower(): n for n in SCHEDULES}
    return by_lower.get(name.lower())


def _even_layer_starts(n_layers: int, num_stages: int, embed_weight: int, output_weight: int) -> tuple[int, ...]:
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


def _parse_split_points(points: list[str], n_layers: int, problems: list[str]) -> tuple[int, ...] | None:
    indices = []
    for point in points:
        prefix, _, index = point.partition(".")
        if prefix != "layers" or not index.isdigit() or not 0 <= int(index) < n_layers:
            problems.append(
                f"{_FLAG}split_points: '{point}' is not a layer FQN of this model; "
                f"use layers.N with 0 <= N < {n_layers}"
            )
            return None
        indices.append(int(index))
    if any(b <= a for a, b in zip(indices, indices[1:])):
        problems.append(
            f"{_FLAG}split_points={','.join(points)}: list the layers in increasing order, each once "
            "(every stage between two split points needs at least one layer)"
        )
        return None
    return (0, *indices, n_layers)


def plan_pipeline(cfg: JobConfig, n_layers: int) -> PipelinePlan:
    """Validate the pipeline options against the model and the batch; raise ConfigError listing every problem."""
    p = cfg.parallelism
    pp, problems = p.pipeline_parallel_degree, []
    schedule = _resolve_schedule(p.pipeline_parallel_schedule)
    if schedule is None:
        missing = [n for n in _SCHEDULE_CLASS_NAMES if n not in SCHEDULES]
        note = f" ({', '.join(missing)} need a newer torch than {torch.__version__})" if missing else ""
        raise ConfigError([
            f"{_FLAG}schedule={p.pipeline_parallel_schedule}: unknown; choose one of {', '.join(SCHEDULES)}{note}"
        ])
    single = schedule in SINGLE_STAGE_SCHEDULES

    # How many stages, and which layers each one holds.
    v_flag = p.pipeline_parallel_stages_per_rank
    if p.pipeline_parallel_split_points:
        starts = _parse_split_points(p.pipeline_parallel_split_points, n_layers, problems)
        if starts is None:
            raise ConfigError(problems)
        num_stages = len(starts) - 1
        if num_stages % pp:
            raise ConfigError([
                f"{_FLAG}split_points: {len(starts) - 2} split points make {num_stages} stages, which do not divide "
                f"evenly over pipeline_parallel_degree={pp} ranks; give pp * stages_per_rank - 1 points"
            ])
        v = num_stages // pp
        if v_flag is not None and v_flag != v:
            problems.append(
                f"{_FLAG}stages_per_rank={v_flag} contradicts the split points, which make {v} stage(s) per rank; "
                "leave stages_per_rank unset"
            )
    else:
        v = v_flag if v_flag is not None else (1 if single else DEFAULT_STAGES_PER_RANK)
        num_stages = pp * v
        e, o = p.pipeline_parallel_embedding_weight, p.pipeline_parallel_output_weight
        if n_layers + e + o < num_stages:
            raise ConfigError([
                f"pipeline: {num_stages} stages ({pp} ranks x {v} per rank) but the model has only {n_layers} "
                f"layers{f' (+{e + o} for embedding/output weights)' if e or o else ''}; lower "
                f"pipeline_parallel_degree or stages_per_rank, or count the embedding/output as layers with "
                f"{_FLAG}embedding_weight / {_FLAG}output_weight"
            ])
        starts = _even_layer_starts(n_layers, num_stages, e, o)
        empty = [s for s in range(1, num_stages - 1) if starts[s + 1] == starts[s]]
        if empty:
            problems.append(
                f"pipeline: an even split of {n_layers} layers over {num_stages} stages with embedding weight {e} and "
                f"output weight {o} leaves stage(s) {empty} without layers; lower the weights or give "
                f"{_FLAG}split_points"
            )
    if single and v != 1:
        problems.append(
            f"{_FLAG}schedule={schedule} runs one stage per rank, but the config asks for {v}; use one of "
            f"{', '.join(n for n in SCHEDULES if n not in SINGLE_STAGE_SCHEDULES)} for several stages per rank"
        )
    if not single and v < 2:
        problems.append(
            f"{_FLAG}schedule={schedule} is a multi-stage schedule and needs >= 2 stages per rank (got {v}); "
            f"use {' or '.join(SINGLE_STAGE_SCHEDULES)} for one stage per rank"
        )
    if schedule in V_SHAPED_SCHEDULES and v != 2:
        problems.append(f"{_FLAG}schedule={schedule} needs exactly 2 stages per rank (got {v})")

    # Microbatches.
    m = p.pipeline_parallel_microbatches or num_stages
    batch = cfg.training.batch_size
    if batch % m:
        problems.append(
            f"pipeline: local batch --training.batch_size={batch} is not divisible by {m} microbatches"
            f"{'' if p.pipeline_parallel_microbatches else ' (the default: one per stage)'}; set "
            f"{_FLAG}microbatches to a divisor of the batch size or change the batch size"
        )
    if schedule == "1F1B" and m < num_stages:
        problems.append(f"{_FLAG}schedule=1F1B needs at least as many microbatches as stages ({num_stages}); got {m}")
    if not single:
        rounds = max(1, m // pp)
        if m < pp:
            problems.append(
                f"{_FLAG}schedule={schedule} needs at least pipeline_parallel_degree={pp} microbatches; got {m}"
            )
        elif schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and m % rounds:
            problems.append(
                f"{_FLAG}schedule={schedule}: {m} microbatches is not a multiple of the number of rounds "
                f"({rounds} = microbatches // pipeline_parallel_degree); use a multiple of {pp}"
            )
    if schedule in ZERO_BUBBLE_SCHEDULES and cfg.training.compile:
        problems.append(
            f"{_FLAG}schedule={schedule} splits backward into input and weight passes, which torch does not support "
            "on compiled blocks; turn off --training.compile or choose another schedule"
        )
    ac = cfg.activation_checkpoint
    if schedule in ZERO_BUBBLE_SCHEDULES and ac.mode == "selective" and ac.selective_ac_option == "op":
        problems.append(
            f"{_FLAG}schedule={schedule} runs backward through each block twice (input, then weight gradients), "
            "which op-level selective activation checkpointing forbids; use --activation_checkpoint.mode=full, "
            "selective with a block interval (selective_ac_option=N), or another schedule"
        )
    if problems:
        raise ConfigError(problems)
    return PipelinePlan(schedule=schedule, pp=pp, microbatches=m, layer_starts=starts)


def prune_to_stage(whole: torch.nn.Module, plan: PipelinePlan, stage_id: int) -> torch.nn.Module:
    """A copy of ``whole`` (a meta-device Transformer) holding only stage ``stage_id``; FQNs unchanged."""
    stage = copy.deepcopy(whole)  # on meta this copies metadata only
    lo, hi = plan.layer_starts[stage_id], plan.layer_starts[stage_id + 1]
    for key in list(stage.layers.keys()):
        if not lo <= int(key) < hi:
            del stage.layers[key]
    if stage_id != 0:
        stage.tok_embeddings = None
    if stage_id != plan.num_stages - 1:
        stage.norm = None
        stage.output = None
    return stage


class ScaledLoss:
    """The loss the last stage back-propagates: ``loss_fn(logits, labels) * scale``, in float64.

    ``scale`` is set per optimizer step (it depends on the global token count). The
    float64 result lets ``PipelineRunner`` divide the scale back out with no visible
    rounding, so the logged loss is the unscaled sum; the gradient reaching the
    float32 logits is the same ``float32(scale)`` as in the non-pipelined step.
    """

    def __init__(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        self.loss_fn = loss_fn
        self.scale = 1.0

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(logits, labels).double() * self.scale


# Dtypes a stage may hand to the next one, by their index in the metadata sent ahead of the tensor.
_WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_MAX_DIMS = 6


class PipelineRunner:
    """This rank's stages and the schedule that drives them."""

    def __init__(self, schedule, stages: list[PipelineStage], loss: ScaledLoss, plan: PipelinePlan,
                 pp_mesh: DeviceMesh):
        self.schedule, self.stages, self.loss = schedule, stages, loss
        self.plan, self.pp_mesh = plan, pp_mesh
        self.has_first = any(s.is_first for s in stages)
        self.has_last = any(s.is_last for s in stages)

    def forward_only(
        self, inputs: torch.Tensor, labels: torch.Tensor, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    ) -> torch.Tensor | None:
        """``loss_fn(model(inputs), labels)`` through the stages, forward only; None on ranks without the last stage.

        For evaluation under ``torch.no_grad()``. The schedule is not used: its state (buffers
        shaped for training microbatches, backward set-up) stays exactly as training left it,
        and the validation batch need not divide into microbatches. The whole local batch goes
        through one stage after another, each stage's output sent point to point to the rank
        holding the next stage; every rank walks the stages in the same order, so each send
        meets its receive.
        """
        pp_rank, group = self.pp_mesh.get_local_rank(), self.pp_mesh.get_group()
        by_id = {stage.stage_index: stage for stage in self.stages}
        n, x, loss = self.plan.num_stages, inputs, None
        for stage_id in range(n):
            if self.plan.stage_owner(stage_id) != pp_rank:
                continue
            stage = by_id[stage_id]
            if stage_id > 0 and self.plan.stage_owner(stage_id - 1) != pp_rank:
                x = _recv(dist.get_global_rank(group, self.plan.stage_owner(stage_id - 1)), stage.device)
            out = stage.submod(x)
            if stage_id == n - 1:
                loss = loss_fn(out, labels)
            elif self.plan.stage_owner(stage_id + 1) == pp_rank:
                x = out
            else:
                _send(out, dist.get_global_rank(group, self.plan.stage_owner(stage_id + 1)))
        return loss

    def step(self, inputs: torch.Tensor, labels: torch.Tensor, scale: float) -> float:
        """Forward and backward of one local batch; returns its loss sum (0.0 on ranks without the last stage)."""
        self.loss.scale = scale
        losses: list[torch.Tensor] = []
        # Only the first stage consumes the tokens; the schedule hands the labels to the last stage's loss.
        args = (inputs,) if self.has_first else ()
        self.schedule.step(*args, target=labels, losses=losses)
        # Under loss parallel each loss is a replicated DTensor: every TP rank holds the full value.
        local = [loss.to_local() if isinstance(loss, DTensor) else loss for loss in losses]
        return sum(float(loss.detach()) for loss in local) / scale if self.has_last else 0.0


def build_pipeline(
    whole: torch.nn.Module,
    plan: PipelinePlan,
    pp_mesh: DeviceMesh,
    device: torch.device,
    materialize: Callable[[torch.nn.Module], torch.nn.Module],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> tuple[PipelineRunner, list[torch.nn.Module]]:
    """Build this rank's stages from the meta model ``whole`` and the schedule over them.

    ``materialize`` parallelizes a pruned stage, allocates it on the device and
    initializes it (the same steps the trainer applies to an unsplit model).
    Returns the runner and the stage modules, in ascending stage order.
    """
    pp_rank = pp_mesh.get_local_rank()
    parts, stages = [], []
    for stage_id in plan.stage_ids(pp_rank):
        part = materialize(prune_to_stage(whole, plan, stage_id))
        parts.append(part)
        stages.append(PipelineStage(part, stage_id, plan.num_stages, device, group=pp_mesh.get_group()))
    loss = ScaledLoss(loss_fn)
    cls = SCHEDULES[plan.schedule]
    # scale_grads=False: the loss already carries the step's normalisation (see ScaledLoss).
    if plan.schedule in SINGLE_STAGE_SCHEDULES:
        schedule = cls(stages[0], n_microbatches=plan.microbatches, loss_fn=loss, scale_grads=False)
    else:
        schedule = cls(stages, n_microbatches=plan.microbatches, loss_fn=loss, scale_grads=False)
    return PipelineRunner(schedule, stages, loss, plan, pp_mesh), parts


def _send(t: torch.Tensor, dst: int) -> None:
    """Send a tensor whose shape and dtype the receiver does not know: metadata first."""
    if t.dtype not in _WIRE_DTYPES or t.dim() > _MAX_DIMS:
        raise TypeError(f"a pipeline stage output of dtype {t.dtype} and {t.dim()} dims cannot be sent")
    meta = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=t.device)
    meta[0], meta[1] = _WIRE_DTYPES.index(t.dtype), t.dim()
    meta[2 : 2 + t.dim()] = torch.tensor(t.shape)
    dist.send(meta, dst)
    dist.send(t.contiguous(), dst)


def _recv(src: int, device: torch.device | str) -> torch.Tensor:
    meta = torch.empty(2 + _MAX_DIMS, dtype=torch.int64, device=device)
    dist.recv(meta, src)
    dtype, ndim = _WIRE_DTYPES[int(meta[0])], int(meta[1])
    out = torch.empty(meta[2 : 2 + ndim].tolist(), dtype=dtype, device=device)
    dist.recv(out, src)
    return out
