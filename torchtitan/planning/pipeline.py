"""The pipeline of a dry run: the trainer's stages and schedule (``build_runner`` builds them), with static
stage shapes.

``pipeline_bubble_s`` prices a rank's bubble from the schedule the trainer builds for the plan
(``pipeline_timeline.py`` simulates its action lists).

The schedule's first step normally exchanges each stage's input and output shapes, and votes on
whether every stage stated them, over the pp group; both read numbers that a fake process group
never delivers. The dry run states every stage's shapes (``stage_io``, worked out from the config
as the model's forward makes them) and skips the vote: every stage is static.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

from torchtitan.compat import skip_pipeline_shape_exchange, stage_gradient_keywords
from torchtitan.config.job_config import Parallelism, Training
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.fsdp import mixed_precision
from torchtitan.distributed.pipeline_parallel import PipelineRunner
from torchtitan.distributed.pipeline_plan import SINGLE_STAGE_SCHEDULES, PipelinePlan, schedules
from torchtitan.models import DecoderConfig
from torchtitan.models.spec import ModelSpec
from torchtitan.planning.pipeline_timeline import Action, StageTimes, Timeline, action_lists, simulate


def make_stages_static(pp_runner: PipelineRunner) -> None:
    """Let the schedule's first step skip the shape exchange and its vote: every stage states its shapes
    (``stage_io``), and a fake process group delivers no numbers to exchange."""

    skip_pipeline_shape_exchange(pp_runner.schedule)


def stage_io(t: Training, p: Parallelism, dims: ParallelDims, spec: ModelSpec, args: DecoderConfig,
             plan: PipelinePlan) -> Callable[[int], dict]:
    """Each stage's example input and output on the meta device (gradients alike), as the model makes them.

    Between stages flows the hidden state [micro-batch, sequence, the family's ``hidden_width``] in the
    compute dtype, as a plain tensor (sharded over the sequence under sequence parallelism). The first
    stage takes token ids; the last returns the logits (one per depth beside them with multi-token
    prediction), a DTensor sharded over the vocabulary under loss parallel. With an MoE auxiliary loss,
    a running sum [1] (float32) travels beside them, last.
    """
    mb = t.batch_size // plan.microbatches
    seq = t.seq_len // dims.cp
    dtype = mixed_precision(t, "cuda").param_dtype
    hidden_seq = seq // dims.tp if dims.tp_enabled and p.enable_sequence_parallel else seq
    meta = torch.device("meta")
    hidden = torch.empty(mb, hidden_seq, spec.model.hidden_width(args), dtype=dtype, device=meta, requires_grad=True)

    def logits() -> torch.Tensor:
        if not dims.loss_parallel_enabled:
            return torch.empty(mb, seq, args.vocab_size, dtype=dtype, device=meta, requires_grad=True)
        local = torch.empty(mb, seq, args.vocab_size // dims.tp, dtype=dtype, device=meta, requires_grad=True)
        return DTensor.from_local(local, dims.tp_mesh(), [Shard(-1)], run_check=False)

    # A model with multi-token prediction returns one logits tensor per depth beside the main one.
    heads = 1 + args.mtp_depths
    # With an auxiliary loss, every stage also returns the running sum [1] of its MoE layers' losses, and each
    # stage past the first takes it in beside the hidden state (models/aux_loss.py).
    moe = args.moe_args() if args.num_experts else None
    aux = (torch.empty(1, dtype=torch.float32, device=meta, requires_grad=True)
           if moe is not None and moe.aux_loss != "none" and moe.aux_loss_coeff > 0 else None)

    def io(stage_id: int) -> dict[str, Any]:
        inputs: torch.Tensor | tuple[torch.Tensor, ...] = (
            torch.empty(mb, seq, dtype=torch.long, device=meta) if stage_id == 0 else hidden)
        last = stage_id == plan.num_stages - 1
        outputs: torch.Tensor | tuple[torch.Tensor, ...] = (
            (logits() if heads == 1 else tuple(logits() for _ in range(heads))) if last else hidden)
        if aux is not None:
            inputs = inputs if stage_id == 0 else (hidden, aux)
            outputs = (*outputs, aux) if isinstance(outputs, tuple) else (outputs, aux)
        return {"input_args": inputs, "output_args": outputs,
                **stage_gradient_keywords(None if stage_id == 0 else inputs, outputs)}

    return io


@dataclasses.dataclass
class _StandInStage:
    """What a torch schedule reads of its stages when it lists its actions: where each stage sits."""

    stage_index: int
    num_stages: int
    group_size: int
    group_rank: int
    submod: torch.nn.Module = dataclasses.field(default_factory=torch.nn.Module)

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1


@functools.cache
def planned_actions(plan: PipelinePlan) -> dict[int, list[Action]]:
    """Every pp rank's compute actions in the schedule the trainer builds for ``plan`` (``build_runner``'s
    class, micro-batches and stage placement; its stages stand-ins, which the listing does not run)."""
    cls = schedules()[plan.schedule]
    stages = [_StandInStage(s, plan.num_stages, plan.pp, 0) for s in plan.stage_ids(0)]
    if plan.schedule in SINGLE_STAGE_SCHEDULES:
        schedule = cls(stages[0], n_microbatches=plan.microbatches, scale_grads=False)
    else:
        schedule = cls(stages, n_microbatches=plan.microbatches, scale_grads=False)
    return action_lists(schedule)


def pipeline_bubble_s(plan: PipelinePlan, phase_s: Mapping[int, tuple[float, float]], pp_rank: int) -> float:
    """The bubble of pp rank ``pp_rank``: its idle time in the simulated schedule of ``plan``.

    ``phase_s``: pp rank -> (forward, backward) compute of its step, all its stages and micro-batches; each of
    its stages takes an equal share of it per micro-batch (the dry run records work by phase, not by stage).
    A pp rank that was not simulated is taken to run as ``pp_rank`` does.
    """
    share = plan.stages_per_rank * plan.microbatches
    times: dict[int, StageTimes] = {}
    for rank in range(plan.pp):
        forward, backward = phase_s.get(rank, phase_s[pp_rank])
        times.update({s: StageTimes(forward / share, backward / share) for s in plan.stage_ids(rank)})
    return _timeline(plan, tuple(times[s] for s in range(plan.num_stages))).bubble_s(pp_rank)


@functools.lru_cache(maxsize=64)
def _timeline(plan: PipelinePlan, stage_times: tuple[StageTimes, ...]) -> Timeline:
    """One simulation serves every rank priced with the same stage times (``cost.estimate`` prices each)."""
    return simulate(planned_actions(plan), dict(enumerate(stage_times)))
