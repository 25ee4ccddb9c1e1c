"""Apply the parallelisms to a Llama 3 model, in a fixed readable order:

    tensor parallel -> activation checkpointing -> torch.compile -> FSDP2

Order matters: TP rewrites the linear layers into DTensor shards first, AC and
compile then wrap each transformer block's (already parallel) forward, and FSDP
comes last so that it shards what the other steps produced and its all-gathers
sit outside the compiled and recomputed regions.

Every step keeps the parameter FQNs unchanged (composable AC, in-place
``Module.compile``, FSDP2), which checkpoints and the layout-invariant init rely on.
"""

from __future__ import annotations

import logging
from functools import partial

import torch
from torch.distributed._composable import checkpoint as composable_checkpoint
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parallelize_llama(model: torch.nn.Module, dims: ParallelDims, cfg: JobConfig, device_type: str) -> torch.nn.Module:
    if dims.tp_enabled or dims.cp_enabled or dims.pp_enabled:
        # The trainer rejects these degrees before any collective; this guards direct callers.
        raise NotImplementedError("tensor, context and pipeline parallelism are not implemented yet")
    if cfg.activation_checkpoint.mode != "none":
        apply_activation_checkpointing(model, cfg.activation_checkpoint.mode, cfg.activation_checkpoint.selective_ac_option)
    if cfg.training.compile:
        apply_compile(model)
    if dims.dp_enabled or dims.fsdp_enabled:
        apply_fsdp(model, dims, cfg, device_type)
    return model


# ---- activation checkpointing ------------------------------------------------
# Ops whose outputs selective AC keeps: the matmuls and attention dominate the
# FLOPs, so recomputing only the cheap pointwise ops and norms saves memory
# for little extra time.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}


def _save_matmuls_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model: torch.nn.Module, mode: str, selective_option: str) -> None:
    """full: recompute every block; selective 'op': keep matmul outputs; selective N: every N-th block."""
    blocks = list(model.layers.values())
    if mode == "full":
        chosen, context_fn = blocks, None
    elif selective_option == "op":
        # Op-level AC records every op in its region, so the region must not contain FSDP's
        # unshard/reshard hooks (they sit on the block): wrap the block's two halves instead.
        chosen = [half for block in blocks for half in (block.attention, block.feed_forward)]
        context_fn = partial(create_selective_checkpoint_contexts, _save_matmuls_policy)
    else:
        try:
            every = int(selective_option)
        except ValueError:
            every = 0
        if every < 1:
            raise ValueError(
                f"activation_checkpoint.selective_ac_option='{selective_option}': use 'op' or a positive integer N"
            )
        chosen, context_fn = blocks[every - 1 :: every], None
    for block in chosen:
        if context_fn is None:
            composable_checkpoint(block)
        else:
            composable_checkpoint(block, context_fn=context_fn)
    logger.info("Activation checkpointing (%s, option %s) on %d modules", mode, selective_option, len(chosen))


# ---- compile -----------------------------------------------------------------
def apply_compile(model: torch.nn.Module) -> None:
    """Compile each block in place: blocks are identical, so one graph serves them all."""
    for block in model.layers.values():
        block.compile(fullgraph=True)
    logger.info("Compiled %d transformer blocks", len(model.layers))


# ---- FSDP2 ----------------------------------------------------------------------
def mixed_precision(cfg: JobConfig, device_type: str) -> MixedPrecisionPolicy:
    param = cfg.training.mixed_precision_param
    if param == "auto":
        # bf16 compute is the norm on GPUs; CPUs run bf16 matmuls slowly, so they default to float32.
        param = "bfloat16" if device_type == "cuda" else "float32"
    return MixedPrecisionPolicy(param_dtype=_DTYPES[param], reduce_dtype=_DTYPES[cfg.training.mixed_precision_reduce])


def reshard_after_forward(policy: str, pp_enabled: bool) -> bool:
    if policy == "always":
        return True
    if policy == "never":
        return False
    # With PP every microbatch would re-gather the parameters it just freed.
    return not pp_enabled


def apply_fsdp(model: torch.nn.Module, dims: ParallelDims, cfg: JobConfig, device_type: str) -> None:
    """Shard each block, then the root (embeddings, final norm, output).

    The mesh is 1-D ``dp_shard_cp`` for FSDP, 2-D ``(dp_replicate, dp_shard_cp)``
    for HSDP (shard within a replica group, all-reduce across groups), and for DDP
    a 2-D ``(dp_replicate, dp_shard=1)`` mesh: FSDP2 then keeps whole parameters
    and all-reduces gradients, which is DDP with the same code path, parameter
    type (DTensor), mixed precision and checkpoint format as FSDP and HSDP.
    """
    mesh = dims.fsdp_mesh()
    mp = mixed_precision(cfg, device_type)
    reshard = reshard_after_forward(cfg.parallelism.fsdp_reshard_after_forward, dims.pp_enabled)
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: keep them gathered.
        last = i == len(blocks) - 1 and cfg.parallelism.fsdp_reshard_after_forward == "default"
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard and not last)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    kind = "DDP" if not dims.fsdp_enabled else ("HSDP" if dims.dp_replicate_enabled else "FSDP")
    logger.info("Applied %s on mesh %s (param %s, reduce %s)", kind, dict(zip(mesh.mesh_dim_names, mesh.shape)),
                mp.param_dtype, mp.reduce_dtype)
