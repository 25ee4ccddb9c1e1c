"""Llama 3's own parallelism: its tensor-parallel plan and its context-parallel binding.

The generic steps (activation checkpointing, compile, FSDP2 and mixed precision) and the order in
which all of them apply are in ``torchtitan/distributed/parallelize.py``; this module says only
which Llama layers TP shards and how, and how a Llama model takes context parallelism.
"""

from __future__ import annotations

import logging
from typing import cast

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from torchtitan.models.common import parallel as common_parallel

logger = logging.getLogger(__name__)


# ---- tensor parallel ---------------------------------------------------------
def apply_tp(model: torch.nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool, loss_parallel: bool) -> None:
    """Megatron-style TP: column-parallel in-projections, row-parallel out-projections.

    With sequence parallelism the activations between the TP regions (norms and
    residual stream) stay sharded along the sequence; the all-reduce of each
    row-parallel output becomes a reduce-scatter and each region's input an
    all-gather. Without it they stay replicated. Every region's input layout is
    stated, so nothing is replicated by accident.
    """
    seq = Shard(1) if sequence_parallel else Replicate()
    common_parallel.apply_tp_ends(model, tp_mesh, seq, loss_parallel)

    for block in cast(torch.nn.ModuleDict, model.layers).values():
        plan: dict[str, ParallelStyle] = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
            "feed_forward.w3": ColwiseParallel(),
            # Each region's input becomes one DTensor before its projections (gathered over the
            # sequence under SP). The projections' input gradients (Partial) are then summed
            # first and reduced once per region: a reduce-scatter under SP, else an all-reduce.
            # Fed a plain tensor, each projection reduced its own: 5 collectives per block
            # instead of 2 (benchmarks/footprint.py, TP rows).
            "attention": PrepareModuleInput(input_layouts=(seq, None), desired_input_layouts=(Replicate(), None)),
            "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        }
        if sequence_parallel:
            plan.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()})
        parallelize_module(block, tp_mesh, plan)
    logger.info("Applied tensor parallel on %d ranks (sequence parallel %s, loss parallel %s)", tp_mesh.size(),
                sequence_parallel, loss_parallel)


# ---- context parallel: the binding every decoder shares (models/common/parallel.py)
apply_cp = common_parallel.apply_cp
