"""DeepSeek-V3's preflight checks, job options, TP and pipeline pruning; its TP plan is the decoder's, MLA giving
its own part (``mla.py``: heads sharded, the latent path whole) and then summing its shared rotary key's
gradient over the TP group (``apply_tp``); CP and EP are the decoder's. Under PP the
multi-token prediction modules sit on the last stage, with a copy of the embedding (``prune_stage``)."""

from __future__ import annotations

import dataclasses
from typing import cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.pipeline_plan import V_SHAPED_SCHEDULES
from torchtitan.models.common import parallel
from torchtitan.models.common.decoder_spec import DECODER_EXPERTS
from torchtitan.models.deepseek_v3.args import DeepSeekV3Args
from torchtitan.models.deepseek_v3.mla import MultiHeadLatentAttention
from torchtitan.models.deepseek_v3.model import DeepSeekV3Model


def check(args: DeepSeekV3Args, dims: ParallelDims, cfg: JobConfig) -> list[str]:
    """The decoder's problems (widths TP must divide, experts EP must divide, the attention backend), and the
    layouts multi-token prediction cannot run in, one line each."""
    problems = parallel.check(args, dims, cfg)
    if args.num_mtp_layers:
        problems += _mtp_problems(args, dims, cfg)
    return problems


def _mtp_problems(args: DeepSeekV3Args, dims: ParallelDims, cfg: JobConfig) -> list[str]:
    """Where the MTP modules cannot run: a CP rank holds chunks of the sequence that the depths roll along, and
    a V-shaped schedule puts the first and the last stage (which both hold the embedding they share) on one
    rank."""
    problems, flag = [], f"--model.mtp_layers={args.num_mtp_layers}"
    if dims.cp > 1:
        problems.append(f"{flag} with --parallelism.context_parallel_degree={dims.cp}: no schedule places the "
                        "multi-token prediction modules there yet (each depth reads the tokens further along the "
                        "sequence, which another CP rank holds); use --parallelism.context_parallel_degree=1 or "
                        "--model.mtp_layers=0")
    schedule = cfg.parallelism.pipeline_parallel_schedule
    if cfg.parallelism.pipeline_parallel_degree > 1 and schedule.lower() in (s.lower() for s in V_SHAPED_SCHEDULES):
        problems.append(f"{flag} with --parallelism.pipeline_parallel_schedule={schedule}: the V-shaped schedule "
                        "puts the first and the last stage, which both hold the embedding the MTP modules share, "
                        "on one rank; use a looped schedule (1F1B, Interleaved1F1B, ...) or --model.mtp_layers=0")
    return problems


def apply_tp(model: torch.nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool, loss_parallel: bool) -> None:
    """The decoder's TP plan (MLA's part from its ``tp_plan``), then every MLA, the MTP blocks' included, sums
    its shared rotary key's gradient over ``tp_mesh``."""
    parallel.apply_tp(model, tp_mesh, sequence_parallel, loss_parallel)
    group = tp_mesh.get_group()
    for module in model.modules():
        if isinstance(module, MultiHeadLatentAttention):
            module.use_tp_group(group)


def prune_stage(stage: nn.Module, layers: range, first: bool, last: bool) -> None:
    """The decoder's pruning, with the MTP modules on the last stage only; there they read the embedding, so the
    last stage keeps a copy of it (distributed/stage_copies.py keeps the two equal), its input still the
    previous stage's hidden states."""
    model = cast(DeepSeekV3Model, stage)
    embedding = model.tok_embeddings
    parallel.prune_stage(stage, layers, first, last)
    if not last:
        model.mtp = None
    elif model.mtp is not None and not first:
        model.tok_embeddings, model.input_is_hidden = embedding, True


def with_job_options(args: DeepSeekV3Args, cfg: JobConfig) -> DeepSeekV3Args:
    """The job's [moe] balancing (the decoder's) and its multi-token prediction options."""
    args = DECODER_EXPERTS.with_moe_options(args, cfg)  # type: ignore[assignment]  # the same dataclass back
    return dataclasses.replace(args, num_mtp_layers=cfg.model.mtp_layers, mtp_loss_weight=cfg.model.mtp_loss_weight)
