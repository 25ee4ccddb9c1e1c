"""``build_runner``: the one way a job's model runner is built, by the trainer and by the planner's dry run.

    model on meta -> model converters (Float8) -> (pipeline: prune to this rank's stages) -> parallelize
    -> allocate -> initialize -> (pipeline: the copies the first and last stage share made equal)
    -> optimizer over every part's parameters -> LR schedule -> (MoE) the experts' balancing

The step's objective, the list of loss terms (``train_step/objective.py``), is built once from the whole
model, before the pipeline split: the cross-entropy, then each ``LOSS_TERMS`` entry the job turns on.

The dry run builds what the trainer builds through this same function, with ``BuildOptions`` saying
where it differs: it parallelizes for the GPU it plans for (``device_type="cuda"``), allocates under
its fake-tensor mode (``allocate``), leaves the fake weights uninitialized (``init_weights=False``)
and states each pipeline stage's shapes (``stage_io``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.layout_init import init_params_layout_invariant
from torchtitan.distributed.parallelize import parallelize
from torchtitan.distributed.pipeline_parallel import build_pipeline
from torchtitan.distributed.stage_copies import StageCopies
from torchtitan.loss import training_loss
from torchtitan.models import describe_backend
from torchtitan.models.attention.backends import has_score_extras
from torchtitan.models.aux_loss import accept_carried_aux_loss
from torchtitan.models.spec import family_model, prune_stage
from torchtitan.optim import build_lr_scheduler, build_optimizer
from torchtitan.optim.muon import MuonSettings
from torchtitan.quantization import apply_converters
from torchtitan.quantization.float8 import install_after_step
from torchtitan.stability.z_loss import ZLossTerm
from torchtitan.train_step.aux_loss import AuxLossTerm
from torchtitan.train_step.callbacks import StepCallbacks
from torchtitan.train_step.experts import ExpertBalance
from torchtitan.train_step.max_logit import MaxLogitTerm, install_qk_clip
from torchtitan.train_step.mtp import MTPTerm
from torchtitan.train_step.objective import TermBuilder, TermSources, build_objective
from torchtitan.train_step.runner import ModelRunner

if TYPE_CHECKING:
    from torchtitan.launch_plan import LaunchPlan

logger = logging.getLogger(__name__)

# The loss terms after the cross-entropy, in the order the step adds them (the order is part of the bits):
# each builds its term from the job, or None where the job has none. A new term is one line here.
LOSS_TERMS: tuple[TermBuilder, ...] = (ZLossTerm.of, MTPTerm.of, AuxLossTerm.of, MaxLogitTerm.of)


@dataclass(frozen=True)
class BuildOptions:
    """Where a build differs from the trainer's own (the defaults): what the planner's dry run asks for."""

    device_type: str | None = None  # the device type to parallelize, build the optimizer and pick the loss for
    allocate: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext  # storage made under it
    init_weights: bool = True  # False: allocate and fill the buffers only
    stage_io: Callable[[int], dict[str, Any]] | None = None  # each pipeline stage's shapes, stated
    describe: bool = True  # log the model, its attention kernel and its pipeline


def build_runner(cfg: JobConfig, dims: ParallelDims, plan: LaunchPlan, device: torch.device,
                 callbacks: StepCallbacks | None = None, options: BuildOptions = BuildOptions()) -> ModelRunner:
    """This rank's model parts (parallelized, allocated on ``device``, initialized), the pipeline schedule
    over them when PP is on, the optimizer and the LR schedule."""
    device_type = options.device_type or device.type
    spec = plan.model_spec
    with torch.device("meta"):
        model = spec.build(plan.model_args)
        # before the pipeline split and TP: they see the new classes
        apply_converters(model, cfg.model, cfg.float8, device_type)
    fpt = spec.model.flops_per_token(plan.model_args, cfg.training.seq_len)
    objective = build_objective(TermSources(cfg, plan, model, dims, training_loss(device_type)), LOSS_TERMS)
    if options.describe:
        _describe(cfg, dims, plan, model.num_params(), fpt, device, has_score_extras(model))

    def materialize(module: torch.nn.Module) -> torch.nn.Module:
        return _materialize(module, cfg, dims, plan, device, device_type, options)

    pp_runner, stage_copies = None, None
    if plan.pipeline is None:
        model_parts = [materialize(model)]
    else:
        pp_mesh = dims.get_mesh("pp")
        assert pp_mesh is not None, "a pipeline plan means PP is on"

        def materialize_stage(module: torch.nn.Module) -> torch.nn.Module:
            stage = materialize(module)
            accept_carried_aux_loss(stage)  # after FSDP: the running auxiliary loss an earlier stage sends
            return stage

        pp_runner, model_parts = build_pipeline(model, plan.pipeline, pp_mesh, device, materialize_stage,
                                                objective, prune_stage, stage_io=options.stage_io,
                                                extra_loss=objective.carried)
        stage_copies = StageCopies.of(model, plan.pipeline, prune_stage, dims, model_parts)
        if stage_copies is not None and options.init_weights:
            stage_copies.sync_values()
    o, s = cfg.optimizer, cfg.lr_scheduler
    # Outside ``allocate``: building allocates nothing (the state comes with the first step), and Muon plans its
    # owners on the host from the mesh's rank tensor, which a fake-tensor ``allocate`` would empty of values.
    optimizer = build_optimizer(
        [p for part in model_parts for p in part.parameters()], name=o.name, lr=o.lr, eps=o.eps,
        weight_decay=o.weight_decay, betas=tuple(o.betas), device_type=device_type, model_parts=model_parts,
        muon=MuonSettings.from_config(o),
    )
    install_qk_clip(optimizer, model_parts, objective, dims.tp_mesh())  # MuonClip; first: Float8's scales see the clip
    install_after_step(optimizer, model_parts, cfg.model, cfg.float8)
    lr_scheduler = build_lr_scheduler(
        optimizer, warmup_steps=s.warmup_steps, decay_ratio=s.decay_ratio, decay_type=s.decay_type,
        lr_min=s.lr_min, total_steps=cfg.training.steps,
    )
    experts = ExpertBalance.of(model_parts, plan.model_args, cfg.moe.load_balance_coeff or 0.0, dims)
    return ModelRunner(model_parts, pp_runner, optimizer, lr_scheduler, objective, dims, device,
                       callbacks if callbacks is not None else StepCallbacks(), fpt, experts, stage_copies)


def _describe(cfg: JobConfig, dims: ParallelDims, plan: LaunchPlan, n_params: int, fpt: float,
              device: torch.device, has_sinks: bool) -> None:
    logger.info("Model %s %s: %s parameters, %.3g FLOPs/token", cfg.model.name, cfg.model.flavor, f"{n_params:,}",
                fpt)
    logger.info(describe_backend(cfg.model.attention_backend, plan.model_args.attn_mask_type, device.type,
                                 compiled=cfg.training.compile, context_parallel=dims.cp_enabled,
                                 score_extras=has_sinks))
    if plan.pipeline is not None:
        logger.info("Pipeline %s, %d microbatches: %s", plan.pipeline.schedule, plan.pipeline.microbatches,
                    plan.pipeline.describe())


def _materialize(model: torch.nn.Module, cfg: JobConfig, dims: ParallelDims, plan: LaunchPlan,
                 device: torch.device, device_type: str, options: BuildOptions) -> torch.nn.Module:
    """Parallelize a meta model (or pipeline stage), allocate it on the device and initialize it.

    Parallelizing runs outside ``options.allocate`` (the mesh's own tensors stay real in a dry run).
    """
    parallelize(model, dims, cfg, device_type)
    family = family_model(model, "build_runner")
    with options.allocate():
        model.to_empty(device=device)
        if not options.init_weights:
            family.init_buffers(buffer_device=device)
        elif cfg.training.seed is None:
            family.init_weights(buffer_device=device)
        else:
            # Same full weights for a given seed whatever the layout; see layout_init.py.
            family.init_buffers(buffer_device=device)
            init_params_layout_invariant(family, cfg.training.seed)
    model.train()
    return model
