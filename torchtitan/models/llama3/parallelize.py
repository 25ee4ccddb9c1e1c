"""Apply the parallelisms to a Llama 3 model, in a fixed readable order:

    (CPU: kernel swap) -> tensor parallel -> context parallel -> activation checkpointing
    -> torch.compile -> FSDP2

Order matters: TP rewrites the linear layers into DTensor shards first, AC and
compile then wrap each transformer block's (already parallel) forward, and FSDP
comes last so that it shards what the other steps produced and its all-gathers
sit outside the compiled and recomputed regions. On CPU the linear and attention modules first
take the eager-CPU kernels (ops/cpu_kernels.py): a class change that the later steps do not see.

Every step keeps the parameter FQNs unchanged (AC replaces forward in place, in-place
``Module.compile``, FSDP2), which checkpoints and the layout-invariant init rely on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial, wraps

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from torchtitan.compat import wait_async_collective
from torchtitan.config import JobConfig
from torchtitan.config.dtypes import DTYPES
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.context_parallel import cp_attention, local_positions
from torchtitan.models.attention import cp_block_causal_attention, cp_document_mask
from torchtitan.models.llama3.model import Attention
from torchtitan.ops.cpu_kernels import onednn_available, use_cpu_kernels

logger = logging.getLogger(__name__)



def parallelize_llama(model: torch.nn.Module, dims: ParallelDims, cfg: JobConfig, device_type: str) -> torch.nn.Module:
    """Parallelize ``model`` (the whole model or one pipeline stage of it) in place."""
    # Without data parallelism (one device, TP, PP, or both) FSDP2 still goes on, on a one-rank
    # mesh, when compute is not float32: it is what applies the mixed-precision policy, so
    # every layout computes in the same dtype. Its TP parameters must share that mesh's root.
    # Under fault tolerance too: FSDP units carry the cross-group all-reduce hook, so every
    # parameter must sit in one (fault_tolerance/hooks.py).
    fsdp_on_one_rank = not (dims.dp_enabled or dims.fsdp_enabled) and (
        mixed_precision(cfg, device_type).param_dtype != torch.float32 or cfg.fault_tolerance.enable)
    if device_type == "cpu":
        onednn = cfg.training.cpu_matmul == "onednn" and not cfg.training.compile
        if n := use_cpu_kernels(model, Attention, onednn_linears=onednn)["linear"]:
            logger.info("%d linear layers compute float32 products on oneDNN (training.cpu_matmul)", n)
    if dims.tp_enabled:
        apply_tp(
            model, dims.tp_mesh(fsdp_on_one_rank=fsdp_on_one_rank),
            sequence_parallel=cfg.parallelism.enable_sequence_parallel,
            loss_parallel=dims.loss_parallel_enabled,
        )
    if dims.cp_enabled:
        apply_cp(model, dims.get_mesh("cp"), cfg.training.seq_len)
    if cfg.activation_checkpoint.mode != "none":
        apply_activation_checkpointing(model, cfg.activation_checkpoint.mode,
                                       cfg.activation_checkpoint.selective_ac_option)
    if cfg.training.compile:
        apply_compile(model)
        if dims.tp_enabled:
            wait_for_embedding_output(model)
    if dims.dp_enabled or dims.fsdp_enabled:
        apply_fsdp(model, dims, cfg, device_type)
    elif fsdp_on_one_rank:
        apply_fsdp(model, dims, cfg, device_type, mesh=dims.one_rank_fsdp_mesh())
    return model


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


def wait_for_embedding_output(model: torch.nn.Module) -> None:
    """Hand the first (compiled) block the embedding's output waited, with its autograd history.

    The embedding's TP output hook redistributes asynchronously, so its output is a pending
    collective's result, and torch 2.13 compiles a block fed one as if its input needed no
    gradient (``compat.wait_async_collective``). The blocks feed each other plain tensors (the
    residual add waits), and a pipeline stage without the embedding receives plain tensors.
    """
    if model.tok_embeddings is not None:
        model.tok_embeddings.register_forward_hook(lambda module, args, output: wait_async_collective(output))


# ---- context parallel --------------------------------------------------------
def apply_cp(model: torch.nn.Module, cp_mesh: DeviceMesh, seq_len: int) -> None:
    """Swap every block's attention (causal and document-masked) for the all-gather CP attention, build
    document masks from the whole sequence's positions, and, when none are given, feed the model the
    rotary positions of this rank's load-balanced sequence chunks."""
    for block in model.layers.values():
        block.attention.sdpa = partial(cp_attention, mesh=cp_mesh)
        block.attention.masked_sdpa = partial(cp_block_causal_attention, mesh=cp_mesh)
    model.document_mask = partial(cp_document_mask, mesh=cp_mesh)
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


# ---- activation checkpointing ------------------------------------------------
# Selective 'op' AC decides per op what a block keeps for backward. The linear layers' products are
# most of the FLOPs and their outputs most of the memory, so it keeps every second one (the 1st,
# 3rd, ... of the block: wq, wv, w1, w2 in a Llama block) and recomputes the others (wk, wo, w3):
# three of seven forward products recomputed, for much less memory (benchmarks/README.md §17).
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

    return create_selective_checkpoint_contexts(policy)


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
    """The N of selective AC every N-th block, None for 'op'; ValueError for anything else."""
    if option == "op":
        return None
    if not (option.isdigit() and int(option) >= 1):
        raise ValueError(f"selective_ac_option={option}: use 'op' or a positive integer N ('op' keeps every second "
                         "linear output, N checkpoints every N-th block)")
    return int(option)


def apply_activation_checkpointing(model: torch.nn.Module, mode: str, selective_option: str) -> None:
    """full: recompute every block; selective 'op': keep every second linear output; selective N: every N-th block."""
    blocks = list(model.layers.values())
    if mode == "full":
        chosen, context_fn = blocks, None
    elif selective_option == "op":
        chosen, context_fn = blocks, _every_second_linear_contexts
    else:
        every = selective_ac_interval(selective_option)
        chosen, context_fn = blocks[every - 1 :: every], None
    for block in chosen:
        _checkpoint_forward(block, context_fn)
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
    return MixedPrecisionPolicy(param_dtype=DTYPES[param], reduce_dtype=DTYPES[cfg.training.mixed_precision_reduce])


def reshard_after_forward(policy: str, pp_enabled: bool) -> bool:
    if policy == "always":
        return True
    if policy == "never":
        return False
    # With PP every microbatch would re-gather the parameters it just freed.
    return not pp_enabled


def apply_fsdp(model: torch.nn.Module, dims: ParallelDims, cfg: JobConfig, device_type: str,
               mesh: DeviceMesh | None = None) -> None:
    """Shard each block, then the root (embeddings, final norm, output).

    The mesh is 1-D ``dp_shard_cp`` for FSDP, 2-D ``(dp_replicate, dp_shard_cp)``
    for HSDP (shard within a replica group, all-reduce across groups), and for DDP
    a 2-D ``(dp_replicate, dp_shard=1)`` mesh: FSDP2 then keeps whole parameters
    and all-reduces gradients, which is DDP with the same code path, parameter
    type (DTensor), mixed precision and checkpoint format as FSDP and HSDP.
    """
    mesh = mesh if mesh is not None else dims.fsdp_mesh()
    mp = mixed_precision(cfg, device_type)
    reshard = reshard_after_forward(cfg.parallelism.fsdp_reshard_after_forward, dims.pp_enabled)
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: keep them gathered.
        last = i == len(blocks) - 1 and cfg.parallelism.fsdp_reshard_after_forward == "default"
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard and not last)
    # The root (embeddings, final norm, output) runs last in forward and first in backward, so
    # resharding it only re-gathers it at once. FSDP2 skips that only when the root's value is
    # left unset, and torch 2.13 honours an explicit True: it cost one extra all-gather of the
    # root per step (measured: benchmarks/README.md section 2, "FSDP root resharding").
    root_reshard = reshard and cfg.parallelism.fsdp_reshard_after_forward != "default"
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=root_reshard)
    if mesh.size() == 1:
        kind = "FSDP on one rank (mixed precision only)"
    else:
        kind = "DDP" if not dims.fsdp_enabled else ("HSDP" if dims.dp_replicate_enabled else "FSDP")
    logger.info("Applied %s on mesh %s (param %s, reduce %s)", kind, dict(zip(mesh.mesh_dim_names, mesh.shape)),
                mp.param_dtype, mp.reduce_dtype)
