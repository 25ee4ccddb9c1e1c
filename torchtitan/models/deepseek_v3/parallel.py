"""DeepSeek-V3's tensor-parallel plan and preflight checks (CP, PP and EP are the shared decoder's).

TP shards the heads: ``wq`` (or ``wq_b``) and ``wkv_b`` column-parallel, ``wo`` row-parallel. The
latent path (``wq_a``, ``q_norm``, ``wkv_a``, ``kv_norm``) is whole on every TP rank, as plain
parameters: attention's input is gathered to the whole sequence (sequence parallelism) and handed in
as a plain tensor, and every TP rank computes the same latents. Their gradients come out whole on every
rank because each gradient that leaves a column-parallel projection is summed over TP on its way back
(its input is Replicate), and the shared rotary key's is summed by MLA itself (``tp_group``). The dense
feed-forwards and MoE follow the shared decoder's plan (``models/common/parallel.py``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import cast

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from torchtitan.config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.common import parallel
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.common.decoder_spec import with_moe_options as parallel_moe_options
from torchtitan.models.deepseek_v3.args import DeepSeekV3Args
from torchtitan.models.deepseek_v3.mla import MultiHeadLatentAttention
from torchtitan.models.moe import MoE

logger = logging.getLogger(__name__)


def _block_plan(block: torch.nn.Module, seq: Shard | Replicate, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    attention = cast(MultiHeadLatentAttention, block.attention)
    plan: dict[str, ParallelStyle] = {
        "attention": PrepareModuleInput(input_layouts=(seq, None), desired_input_layouts=(Replicate(), None),
                                        use_local_output=True),
        "attention.wq" if attention.wq is not None else "attention.wq_b": ColwiseParallel(),
        "attention.wkv_b": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=seq),
    }
    if isinstance(block.feed_forward, MoE):
        plan["feed_forward"] = PrepareModuleInputOutput(
            input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Replicate(),), desired_output_layouts=(seq,), use_local_output=True)
    else:
        plan.update({
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        })
    if sequence_parallel:
        plan.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()})
    return plan


def apply_tp(model: torch.nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool, loss_parallel: bool) -> None:
    """TP (and SP) for a ``DeepSeekV3Model`` or a pipeline stage of it; see the module docstring."""
    seq = Shard(1) if sequence_parallel else Replicate()
    parallel.apply_tp_ends(model, tp_mesh, seq, loss_parallel)
    for block in cast(Decoder, model).layers.values():
        parallelize_module(block, tp_mesh, _block_plan(block, seq, sequence_parallel))
        cast(MultiHeadLatentAttention, block.attention).tp_group = tp_mesh.get_group()
    logger.info("Applied tensor parallel on %d ranks to MLA (heads sharded, latent whole; sequence parallel %s, "
                "loss parallel %s; experts replicated over TP)", tp_mesh.size(), sequence_parallel, loss_parallel)


def check(args: DeepSeekV3Args, dims: ParallelDims, cfg: JobConfig) -> list[str]:
    """The shared decoder's problems (widths TP must divide, experts EP must divide, ...), and the layouts
    multi-token prediction cannot run in yet, one line each."""
    problems = parallel.check_decoder(args, dims.tp, cfg.parallelism.pipeline_parallel_degree, cfg.model.flavor,
                                      ep=dims.ep)
    if args.num_mtp_layers:
        # Its modules read the token ids and the shared embedding beside the last block's output (one stage
        # has not both), roll the tokens along the whole sequence (a CP rank holds chunks of it), and have no
        # TP plan yet.
        for flag, degree in (("pipeline_parallel_degree", cfg.parallelism.pipeline_parallel_degree),
                             ("context_parallel_degree", dims.cp), ("tensor_parallel_degree", dims.tp)):
            if degree > 1:
                problems.append(f"--model.mtp_layers={args.num_mtp_layers} with --parallelism.{flag}={degree}: no "
                                f"schedule places the multi-token prediction modules there yet; use "
                                f"--parallelism.{flag}=1 or --model.mtp_layers=0")
    return problems


def with_job_options(args: DeepSeekV3Args, cfg: JobConfig) -> DeepSeekV3Args:
    """The job's [moe] balancing (the shared decoder's) and its multi-token prediction options."""
    args = parallel_moe_options(args, cfg)
    return dataclasses.replace(args, num_mtp_layers=cfg.model.mtp_layers, mtp_loss_weight=cfg.model.mtp_loss_weight)
