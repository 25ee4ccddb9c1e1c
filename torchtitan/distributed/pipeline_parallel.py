"""Pipeline parallelism: split the model into stages by layers and run them with a pipeline schedule.

Three parts, each usable on its own:

- ``PipelinePlan`` (``pipeline_plan.py``) says how many stages there are, which layers
  each holds and how many microbatches a local batch is cut into, worked out from the
  config with the checks that the schedule accepts all of that; preflight calls it
  before any process group exists.
- ``prune_to_stage`` turns a copy of the whole (meta-device) model into one stage,
  through the model family's ``prune_stage`` (its ``ModelSpec``): the blocks it does not
  own are dropped from the ``layers`` ModuleDict (keyed by original index), and the parts
  before the first block and after the last stay on the first and last stage only.
  Parameter FQNs therefore stay those of the whole model, which the layout-invariant init
  and checkpoints key on.
- ``build_pipeline`` prunes, parallelizes and initializes this rank's stages (through
  a caller-supplied ``materialize``), wraps each in a ``PipelineStage`` and builds the
  schedule; ``PipelineRunner.step`` then runs one local batch through it, and
  ``PipelineRunner.forward_only`` runs one through the stages without the schedule
  (validation).

Placement: stage ``s`` of ``S = pp * v`` lives on pp rank ``s % pp`` ("looped"), so
rank ``r`` holds stages ``r, r + pp, ...``. ZBVZeroBubble and DualPipeV need the V shape instead:
rank ``r`` holds stages ``r`` and ``2 * pp - 1 - r``.

Loss and gradients: the last stage computes the trainer's loss (a sum of token
losses) times the step's normalisation, exactly the quantity the non-pipelined step
back-propagates, and the schedule is told not to rescale gradients. The pipelining
runtime switches off FSDP's gradient sync during the microbatch backwards and
reduces once per schedule step.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage

from torchtitan.batch import Batch
from torchtitan.compat import (
    in_pipeline_shape_inference,
    mark_pipeline_shape_inference,
    step_keeping_no_outputs,
    warm_up_other_ranks_only,
)
from torchtitan.distributed.collectives import local_value
from torchtitan.distributed.pipeline_plan import (
    OVERLAPPED_IN_SEQUENCE_NOTE,
    SINGLE_STAGE_SCHEDULES,
    PipelinePlan,
    schedules,
)

logger = logging.getLogger(__name__)

# (stage, the layers it keeps, is it the first stage, is it the last) -> None: prunes the stage in place.
PruneStage = Callable[[torch.nn.Module, range, bool, bool], None]


def prune_to_stage(whole: torch.nn.Module, plan: PipelinePlan, stage_id: int, prune: PruneStage) -> torch.nn.Module:
    """A copy of ``whole`` (a meta-device model) holding only stage ``stage_id``; FQNs unchanged."""
    stage = copy.deepcopy(whole)  # on meta this copies metadata only
    layers = range(plan.layer_starts[stage_id], plan.layer_starts[stage_id + 1])
    prune(stage, layers, stage_id == 0, stage_id == plan.num_stages - 1)
    return stage


class OutputTerm(Protocol):
    """A loss term that the last stage's output carries beside the logits (the MoE auxiliary loss,
    ``train_step/aux_loss.py``): split off the output, then added to the scaled loss."""

    def split(self, output: torch.Tensor | tuple[torch.Tensor, ...]
              ) -> tuple[torch.Tensor | tuple[torch.Tensor, ...], torch.Tensor | None]: ...

    def add_to(self, objective: torch.Tensor, aux: torch.Tensor) -> torch.Tensor: ...


class ScaledLoss:
    """The loss the last stage back-propagates: ``loss_fn(logits, labels) * scale``, in float64, plus the
    ``extra`` term the output carries, when there is one.

    ``scale`` is set per optimizer step (it depends on the global token count). The
    float64 result lets ``PipelineRunner`` divide the scale back out with no visible
    rounding, so the logged loss is the unscaled sum; the gradient reaching the
    float32 logits is the same ``float32(scale)`` as in the non-pipelined step. The scaled
    main losses are kept apart for that log (``take_main``): the extra term is not logged as loss.
    """

    def __init__(self, loss_fn: Callable[..., torch.Tensor], extra: OutputTerm | None = None):
        # (the last stage's output, labels): the logits, or a tuple with them (multi-token prediction's depths)
        self.loss_fn, self.extra = loss_fn, extra
        self.scale: torch.Tensor | float = 1.0
        self._main: list[torch.Tensor] = []

    def __call__(self, output: torch.Tensor | tuple[torch.Tensor, ...], labels: torch.Tensor) -> torch.Tensor:
        term = None
        if self.extra is not None:
            output, term = self.extra.split(output)
        scaled = self.loss_fn(output, labels).double() * self.scale
        if not in_pipeline_shape_inference():  # a schedule's first step learns shapes on stand-in tensors
            self._main.append(local_value(scaled).detach())
        return scaled if term is None or self.extra is None else self.extra.add_to(scaled, term)

    def take_main(self) -> list[torch.Tensor]:
        """The scaled main losses since the last call, in the order they were computed (microbatch order)."""
        main, self._main = self._main, []
        return main


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
        self, batch: Batch, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor | None:
        """``loss_fn(model(inputs), labels)`` of ``batch`` through the stages, forward only; None on ranks without
        the last stage.

        For evaluation under ``torch.no_grad()``. The schedule is not used: its state (buffers
        shaped for training microbatches, backward set-up) stays exactly as training left it,
        and the validation batch need not divide into microbatches. The whole local batch goes
        through one stage after another, each stage's output sent point to point to the rank
        holding the next stage; every rank walks the stages in the same order, so each send
        meets its receive. The batch's other model inputs (positions, for document-masked attention)
        go to every stage.
        """
        pp_rank, group = self.pp_mesh.get_local_rank(), self.pp_mesh.get_group()
        by_id = {stage.stage_index: stage for stage in self.stages}
        n, x, loss, kwargs = self.plan.num_stages, batch.inputs, None, batch.model_kwargs()
        for stage_id in range(n):
            if self.plan.stage_owner(stage_id) != pp_rank:
                continue
            stage = by_id[stage_id]
            if stage_id > 0 and self.plan.stage_owner(stage_id - 1) != pp_rank:
                x = _recv(dist.get_global_rank(group, self.plan.stage_owner(stage_id - 1)), stage.device)
            out = stage.submod(x, **kwargs)
            if stage_id == n - 1:
                loss = loss_fn(out, batch.labels)
            elif self.plan.stage_owner(stage_id + 1) == pp_rank:
                x = out
            else:
                _send(out, dist.get_global_rank(group, self.plan.stage_owner(stage_id + 1)))
        return loss

    def step(self, batch: Batch, scale: torch.Tensor, extra: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Forward and backward of one local batch; returns its loss sum, float64 on the device (0 on ranks
        without the last stage). ``scale`` is a float64 0-dim tensor; nothing is read on the host.

        The batch's other model inputs (positions, for document-masked attention) reach every stage:
        the schedule splits keyword inputs into microbatches like the tokens and hands each stage its
        microbatch's; so do ``extra`` keyword inputs (multi-token prediction's input ids, which the last
        stage's MTP modules embed).
        """
        self.loss.scale = scale
        # Only the first stage consumes the tokens; the schedule hands the labels to the last stage's loss.
        args = (batch.inputs,) if self.has_first else ()
        self.schedule.step(*args, target=batch.labels, **batch.model_kwargs(), **(extra or {}),
                           **step_keeping_no_outputs(self.schedule.step))
        total = torch.zeros((), dtype=torch.float64, device=scale.device)
        for loss in self.loss.take_main():  # one at a time, in order: the same rounding as a sum of Python floats
            total = total + loss
        return total / scale if self.has_last else total


def build_pipeline(
    whole: torch.nn.Module,
    plan: PipelinePlan,
    pp_mesh: DeviceMesh,
    device: torch.device,
    materialize: Callable[[torch.nn.Module], torch.nn.Module],
    loss_fn: Callable[..., torch.Tensor],
    prune: PruneStage,
    stage_io: Callable[[int], dict[str, Any]] | None = None,
    extra_loss: OutputTerm | None = None,
) -> tuple[PipelineRunner, list[torch.nn.Module]]:
    """Build this rank's stages from the meta model ``whole`` and the schedule over them.

    ``materialize`` parallelizes a pruned stage, allocates it on the device and
    initializes it (the same steps the trainer applies to an unsplit model); ``prune`` is the
    model family's ``prune_stage``.
    ``stage_io(stage_id)``, when given, states a stage's example inputs and outputs (and their
    gradients) as ``PipelineStage`` keywords, so the schedule need not exchange shapes at its
    first step (the planner's dry run needs this: it cannot read the exchanged sizes).
    ``extra_loss``: a term the last stage's output carries beside the logits, added to its loss.
    Returns the runner and the stage modules, in ascending stage order.
    """
    pp_rank = pp_mesh.get_local_rank()
    parts, stages = [], []
    for stage_id in plan.stage_ids(pp_rank):
        part = materialize(prune_to_stage(whole, plan, stage_id, prune))
        parts.append(part)
        io = stage_io(stage_id) if stage_io is not None else {}
        stage = PipelineStage(part, stage_id, plan.num_stages, device, group=pp_mesh.get_group(), **io)
        mark_pipeline_shape_inference(stage)  # so that an MoE does not count the forward that learns shapes
        warm_up_other_ranks_only(stage)  # torch 2.11's V-shaped schedules sent to their own rank, which gloo cannot
        stages.append(stage)
    loss = ScaledLoss(loss_fn, extra_loss)
    cls = schedules()[plan.schedule]
    # scale_grads=False: the loss already carries the step's normalisation (see ScaledLoss).
    if plan.schedule in SINGLE_STAGE_SCHEDULES:
        schedule = cls(stages[0], n_microbatches=plan.microbatches, loss_fn=loss, scale_grads=False)
    else:
        schedule = cls(stages, n_microbatches=plan.microbatches, loss_fn=loss, scale_grads=False)
    if plan.schedule == "DualPipeV":
        logger.info(OVERLAPPED_IN_SEQUENCE_NOTE)
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
