"""Llama 3's own parallelism: its tensor-parallel plan and its context-parallel binding.

The generic steps (activation checkpointing, compile, FSDP2 and mixed precision) and the order in
which all of them apply are in ``torchtitan/distributed/parallelize.py``; this module says only
which Llama layers TP shards and how, and how a Llama model takes context parallelism.
"""

from __future__ import annotations

import logging

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

from torchtitan.distributed.context_parallel import local_positions
from torchtitan.models.attention import ContextParallelAttention

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
    norm_style = SequenceParallel() if sequence_parallel else None
    top: dict[str, ParallelStyle] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.norm is not None and norm_style is not None:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        # Loss parallel keeps the logits sharded over the vocabulary; cross entropy then
        # never gathers a [tokens, vocab] tensor.
        top["output"] = ColwiseParallel(
            input_layouts=seq,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if top:
        parallelize_module(model, tp_mesh, top)
        # Each style distributed its module's weight on its own; both are Shard(0) (the vocabulary
        # rows), so a tied model keeps one of them for both modules.
        model.tie_weights()

    for block in model.layers.values():
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


# ---- context parallel --------------------------------------------------------
def apply_cp(model: torch.nn.Module, cp_mesh: DeviceMesh, seq_len: int) -> None:
    """Select the context-parallel attention backend (all-gather K/V, document masks from the whole
    sequence's positions) and, when the forward gets no positions, feed the model the rotary positions
    of this rank's load-balanced sequence chunks."""
    model.use_attention_backend(ContextParallelAttention(cp_mesh))
    cp_rank, cp_size = cp_mesh.get_local_rank(), cp_mesh.size()
    cached: dict[torch.device, torch.Tensor] = {}

    def add_positions(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if kwargs.get("positions") is None and len(args) < 2:
            device = module.rope_cache.device
            if device not in cached:
                cached[device] = local_positions(seq_len, cp_rank, cp_size, device)
            kwargs = {**kwargs, "positions": cached[device]}
        return args, kwargs

    model.register_forward_pre_hook(add_positions, with_kwargs=True)
    logger.info("Applied context parallel on %d ranks (all-gather K/V, load-balanced chunks)", cp_size)
