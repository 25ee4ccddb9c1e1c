"""Apply the parallelisms to a model of any family, in a fixed readable order:

    (CPU: oneDNN linears) -> the family's tensor parallel plan -> the attention backend (context
    parallelism's included) -> expert parallelism -> activation checkpointing -> torch.compile -> FSDP2

Order matters: TP rewrites the linear layers into DTensor shards first (where EP borrows TP's ranks,
each MoE layer is first split over TP: each TP rank routes its own tokens), EP shards the experts over
``ep`` (before FSDP, which shards each rank's experts over ``efsdp``), AC and compile then wrap
each block's (already parallel) forward, and FSDP comes last so that it shards what the other
steps produced and its all-gathers sit outside the compiled and recomputed regions. On CPU the
float32 linear layers first move to oneDNN (ops/cpu_kernels.py, ``training.cpu_matmul``): the same
parameters in a module the later steps do not tell apart.

What differs per family (which layers TP shards, how attention runs) comes from the family's model
class (``Decoder`` or its subclass, ``ModelSpec.model`` in ``torchtitan/models/spec.py``: ``apply_tp``,
``use_attention``, ``split_moe_over_tp``, ``apply_ep``); AC, compile, FSDP and mixed precision are the
same for all and live beside this module. Every step keeps the parameter FQNs unchanged (AC replaces forward in
place, in-place ``Module.compile``, FSDP2), which checkpoints and the layout-invariant init rely on.
"""

from __future__ import annotations

import logging

import torch

from torchtitan.compat import split_backward_takes_custom_functions
from torchtitan.config import JobConfig
from torchtitan.distributed.activation_checkpoint import apply_activation_checkpointing
from torchtitan.distributed.compile import apply_compile, wait_for_embedding_output
from torchtitan.distributed.fsdp import apply_fsdp, mixed_precision
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.pipeline_plan import ZERO_BUBBLE_SCHEDULES
from torchtitan.models.spec import family_model
from torchtitan.ops.cpu_kernels import use_onednn_linears
from torchtitan.ops.cpu_matmul import resolve_cpu_matmul

logger = logging.getLogger(__name__)


def fsdp_on_one_rank(dims: ParallelDims, cfg: JobConfig, device_type: str) -> bool:
    """Whether FSDP2 goes on a one-rank mesh although no data parallelism asks for it.

    Without data parallelism (one device, TP, PP, or both) FSDP2 still goes on when compute is
    not float32: it is what applies the mixed-precision policy, so every layout computes in the
    same dtype. Under fault tolerance too: FSDP units carry the cross-group all-reduce hook, so
    every parameter must sit in one (fault_tolerance/hooks.py).
    """
    return not (dims.dp_enabled or dims.fsdp_enabled) and (
        mixed_precision(cfg.training, device_type).param_dtype != torch.float32 or cfg.fault_tolerance.enable)


def _onednn_linears(model: torch.nn.Module, dims: ParallelDims, cfg: JobConfig) -> None:
    """Move ``model``'s float32 linear layers to oneDNN, unless the schedule's weight pass cannot go through them."""
    schedule = cfg.parallelism.pipeline_parallel_schedule
    if dims.pp_enabled and schedule in ZERO_BUBBLE_SCHEDULES and not split_backward_takes_custom_functions():
        # oneDNN's linear is a custom autograd function, whose node torch 2.11's weight pass cannot start from.
        logger.warning("training.cpu_matmul=%s: the linear layers keep torch's products: torch %s's %s cannot take "
                       "a weight gradient through oneDNN's linear (docs/versions.md)", cfg.training.cpu_matmul,
                       torch.__version__, schedule)
    elif n := use_onednn_linears(model):
        logger.info("%d linear layers compute float32 products on oneDNN (training.cpu_matmul=%s)", n,
                    cfg.training.cpu_matmul)


def warn_unused_dispatch_option(cfg: JobConfig) -> None:
    """Say that ``--moe.dispatch_gpus_per_node`` does nothing without expert parallelism (it is not refused: a
    config written for a cluster may be run, or searched by the planner, in layouts without EP)."""
    if cfg.moe.dispatch_gpus_per_node:
        logger.warning("--moe.dispatch_gpus_per_node=%d has no effect: expert parallelism is off (every expert is on "
                       "each rank, no token is sent)", cfg.moe.dispatch_gpus_per_node)


def parallelize(model: torch.nn.Module, dims: ParallelDims, cfg: JobConfig, device_type: str) -> torch.nn.Module:
    """Parallelize ``model`` (the whole model or one pipeline stage of it) in place."""
    family = family_model(model, "parallelize")  # the family's model class: its TP plan, attention, experts
    one_rank = fsdp_on_one_rank(dims, cfg, device_type)
    if device_type == "cpu" and resolve_cpu_matmul(cfg.training.cpu_matmul) == "onednn" and not cfg.training.compile:
        _onednn_linears(model, dims, cfg)
    if dims.tp_enabled:
        # TP parameters must share the root of the mesh FSDP goes on, one-rank FSDP included.
        tp_mesh = dims.tp_mesh()
        assert tp_mesh is not None, "TP is on"
        if dims.ep_borrows_tp:
            # Before the TP plan, which then gives each MoE layer its rank's sequence shard.
            family.split_moe_over_tp(tp_mesh)
        family.apply_tp(tp_mesh, cfg.parallelism.enable_sequence_parallel, dims.loss_parallel_enabled)
    cp_mesh = dims.get_mesh("cp") if dims.cp_enabled else None
    assert cp_mesh is not None or not dims.cp_enabled, "CP is on"
    family.use_attention(cfg.model.attention_backend, device_type, cp_mesh, cfg.training.seq_len)
    experts: list[torch.nn.Module] = []
    if dims.ep_enabled:
        ep_mesh = dims.get_mesh("ep")
        assert ep_mesh is not None, "EP is on"
        experts = family.apply_ep(ep_mesh)
    else:
        warn_unused_dispatch_option(cfg)
    if cfg.activation_checkpoint.mode != "none":
        apply_activation_checkpointing(model, cfg.activation_checkpoint.mode,
                                       cfg.activation_checkpoint.selective_ac_option)
    if cfg.training.compile:
        apply_compile(model)
        if dims.tp_enabled:
            wait_for_embedding_output(model)
    if dims.dp_enabled or dims.fsdp_enabled:
        apply_fsdp(model, dims, cfg, device_type, experts=experts)
    elif one_rank:
        apply_fsdp(model, dims, cfg, device_type, mesh=dims.one_rank_fsdp_mesh())
    return model
