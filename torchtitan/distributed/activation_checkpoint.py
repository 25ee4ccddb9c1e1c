"""Activation checkpointing of a model's blocks: full, selective per op, or every N-th block.

It applies to any model whose repeated blocks sit in ``model.layers`` (a ModuleDict), the
contract of ``torchtitan/models/spec.py``. Each chosen block's ``forward`` is replaced in place,
so parameter FQNs stay unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import wraps
from typing import TYPE_CHECKING

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

from torchtitan.compat.checkpointing import selective_contexts_without_profiler_markers
from torchtitan.distributed.group_labels import extra_group_labels, on_way_back
from torchtitan.ops.cpu_kernels import onednn_available

if TYPE_CHECKING:
    from torchtitan.compat.autograd import OpOverload

logger = logging.getLogger(__name__)

# Selective 'op' AC decides per op what a block keeps for backward. The linear layers' products are
# most of the FLOPs and their outputs most of the memory, so it keeps every second one (the 1st,
# 3rd, ... of the block: wq, wv, w1, w2 in a Llama block) and recomputes the others (wk, wo, w3):
# three of seven forward products recomputed, for much less memory (benchmarks/history.md §17).
# Attention's output is kept (recomputing it costs the most per byte), and so is a tensor-parallel
# reduce-scatter's, so that the recompute does not communicate again. Everything else (norms,
# pointwise ops) is recomputed.
_LINEAR_PRODUCTS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    *([torch.ops.mkldnn._linear_pointwise.default] if onednn_available() else []),  # ops/cpu_kernels.py
}
_ALWAYS_SAVE = {
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
}


def _per_op_contexts(policy: Callable[..., CheckpointPolicy]) -> tuple[object, object]:
    """SAC's contexts for ``policy``, blind to profiler markers: FSDP's hooks on a unit inside a block (the
    expert-parallel experts) open a different number of ``record_function`` ranges in the recompute than in the
    forward (compat/checkpointing.py)."""
    return selective_contexts_without_profiler_markers(policy)


def _every_second_linear_contexts():
    """SAC contexts for one checkpointed call, with their own count of linear products.

    ``checkpoint`` calls this once per block forward; the forward and its recompute each count
    from zero, so both see the same op sequence and agree on which outputs were kept.
    """
    seen = {False: 0, True: 0}  # ctx.is_recompute -> linear products so far

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op in _LINEAR_PRODUCTS:
            seen[ctx.is_recompute] += 1
            keep = seen[ctx.is_recompute] % 2 == 1
        else:
            keep = op in _ALWAYS_SAVE
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return _per_op_contexts(policy)


# Selective 'moe' AC, for MoE blocks with MLA or grouped-query attention (as the DeepSeek-V3 report recomputes):
# a block keeps what costs the most to recompute per byte kept and recomputes the rest.
# Kept: every all-to-all output (dispatch, combine and the token counts: recomputing them would send the tokens
# again, the dearest thing a block does), the routed experts' grouped GEMMs (most of a block's FLOPs), attention
# (as in 'op'), a tensor-parallel reduce-scatter, and the other linears' outputs (dense feed-forward, shared
# experts, MLA's down-projections wq_a/wkv_a, whose latent outputs are narrow, and wo).
# Recomputed: norms, SiLU and the SwiGLU product, the router (a GEMM to a few hundred experts, cheap, and its
# top-k) and MLA's up-projections wq_b/wkv_b: their outputs are as wide as all heads' queries or keys and values
# from a latent of a few hundred columns, the cheapest GEMM FLOPs per byte of the block.
_KEPT_BY_MOE_POLICY = {
    *_ALWAYS_SAVE,
    torch.ops._c10d_functional.all_to_all_single.default,
    *([torch.ops.aten._grouped_mm.default] if hasattr(torch.ops.aten, "_grouped_mm") else []),
    *([torch.ops.aten._scaled_grouped_mm.default] if hasattr(torch.ops.aten, "_scaled_grouped_mm") else []),
}


def keep_as_attention(op: OpOverload) -> None:
    """Every per-op policy keeps ``op``'s output as it keeps a fused attention kernel's: the planner's stand-in
    for a kernel the CPU lacks (planning/fused_attention.py) must be kept where the kernel it prices would be."""
    _ALWAYS_SAVE.add(op)
    _KEPT_BY_MOE_POLICY.add(op)


# The modules whose linear products 'moe' recomputes: ops alone cannot tell wq_b's mm from wo's, so a forward
# hook on each (by its name in the block) marks the ops that run inside it.
_RECOMPUTED_MODULES = ("router", "wq_b", "wkv_b")
_inside_recomputed = [0]


def _enter_recomputed(module: torch.nn.Module, args: object) -> None:
    _inside_recomputed[0] += 1


def _leave_recomputed(module: torch.nn.Module, args: object, output: object) -> None:
    _inside_recomputed[0] -= 1


def _moe_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """'moe': the forward and its recompute run the same ops inside the same marked modules, so they agree."""
    if op in _KEPT_BY_MOE_POLICY or (op in _LINEAR_PRODUCTS and not _inside_recomputed[0]):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _moe_contexts():
    return _per_op_contexts(_moe_policy)


def _mark_recomputed_modules(block: torch.nn.Module) -> int:
    """Hook the block's router and MLA up-projections so that '_moe_policy' recomputes their products."""
    marked = 0
    for name, module in block.named_modules():
        if name.rsplit(".", 1)[-1] in _RECOMPUTED_MODULES:
            module.register_forward_pre_hook(_enter_recomputed)
            module.register_forward_hook(_leave_recomputed, always_call=True)
            marked += 1
    return marked


# Selective 'exchange' AC: full AC but for the dispatched tokens' exchange across nodes, whose recompute would send
# them over the network again. Kept: the output of every expert dispatch's all-to-all (tokens, counts, with the
# two-hop dispatch its first hop's expert ids and weights) but the two-hop dispatch's second hop (its group labelled
# ep_intra_node: the node's own ranks, NVLink); the ways back (group_labels.way_back) are recomputed, and all the
# rest. Half of full AC's expert exchanges over the network are then sent once instead of twice, for half the memory
# of keeping both ways (DeepSeek-V3 671B: benchmarks §39).
def _exchange_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if op is torch.ops._c10d_functional.all_to_all_single.default and not on_way_back():
        within_node = extra_group_labels().get(args[3]) == "ep_intra_node"
        return CheckpointPolicy.PREFER_RECOMPUTE if within_node else CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _exchange_contexts():
    return _per_op_contexts(_exchange_policy)


# Per-op policies by name (selective_ac_option); 'op' is the one for dense blocks.
PER_OP_POLICIES = ("op", "moe", "exchange")


def is_per_op(option: str) -> bool:
    """Whether selective AC with ``option`` decides per op (keeps every block, recomputes part of each)."""
    return option in PER_OP_POLICIES


def _checkpoint_forward(module: torch.nn.Module, context_fn: Callable | None) -> None:
    """Make ``module.forward`` recompute itself in backward, in place.

    Replacing the bound ``forward`` (instead of wrapping the module) keeps the
    parameter FQNs, and keeps the region to the forward body: FSDP's unshard and
    reshard run in the module's hooks, outside it. ``torch.compile`` traces
    non-reentrant ``checkpoint`` (with or without a selective policy), so a
    compiled block keeps its AC.
    """
    inner = module.forward
    kwargs = {"context_fn": context_fn} if context_fn is not None else {}

    @wraps(inner)
    def forward(*args, **kw):
        return checkpoint(inner, *args, use_reentrant=False, **kwargs, **kw)

    module.forward = forward


def selective_ac_interval(option: str) -> int | None:
    """The N of selective AC every N-th block, None for a per-op policy; ValueError for anything else."""
    if is_per_op(option):
        return None
    if not (option.isdigit() and int(option) >= 1):
        raise ValueError(f"selective_ac_option={option}: use 'op', 'moe', 'exchange' or a positive integer N ('op' "
                         "keeps every second linear output, 'moe' the all-to-alls, grouped GEMMs and linears but the "
                         "router's and MLA's up-projections, 'exchange' the expert dispatch's all-to-alls across nodes "
                         "only, N checkpoints every N-th block)")
    return int(option)


def apply_activation_checkpointing(model: torch.nn.Module, mode: str, selective_option: str) -> None:
    """full: recompute every block; selective 'op': keep every second linear output; selective 'moe': keep the
    all-to-alls, grouped GEMMs and linears but the router's and MLA's up-projections; selective 'exchange': keep
    the expert dispatch's all-to-alls across nodes only; selective N: every N-th block."""
    layers = model.layers
    if not isinstance(layers, torch.nn.ModuleDict):  # every family's decoder holds its blocks in one
        raise TypeError(f"activation checkpointing wraps the blocks in {type(model).__name__}.layers, a "
                        f"{type(layers).__name__} here: it takes a decoder whose layers are an nn.ModuleDict")
    blocks = list(layers.values())
    if mode == "full":
        chosen, context_fn = blocks, None
    elif selective_option == "op":
        chosen, context_fn = blocks, _every_second_linear_contexts
    elif selective_option == "moe":
        chosen, context_fn = blocks, _moe_contexts
        for block in blocks:
            _mark_recomputed_modules(block)
    elif selective_option == "exchange":
        chosen, context_fn = blocks, _exchange_contexts
    else:
        every = selective_ac_interval(selective_option)
        assert every is not None, "None only for 'op', handled above"
        chosen, context_fn = blocks[every - 1 :: every], None
    for block in chosen:
        _checkpoint_forward(block, context_fn)
    logger.info("Activation checkpointing (%s, option %s) on %d modules", mode, selective_option, len(chosen))
