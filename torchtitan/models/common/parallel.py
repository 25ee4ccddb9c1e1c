"""The decoder's parallelism (every family's): the tensor-parallel plan, the attention backend a run
selects (context parallelism's included), expert parallelism, the pipeline stage pruning, and the
preflight checks of the model against a layout."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from torchtitan.config import job_config
from torchtitan.distributed.context_parallel import local_positions
from torchtitan.distributed.float8_tp import LinearStyles
from torchtitan.distributed.lifecycle import device_type
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.attention import backend_problems, select_backend
from torchtitan.models.common.config import DecoderConfig

if TYPE_CHECKING:  # the decoder's methods call these (decoder.py imports this module)
    from torchtitan.models.common.decoder import Decoder

logger = logging.getLogger(__name__)


def apply_tp_ends(decoder: Decoder, tp_mesh: DeviceMesh, seq: Shard | Replicate, loss_parallel: bool) -> None:
    """The embedding (row-parallel), the final norm (under SP) and the output (column-parallel)."""
    from torch.distributed.tensor.parallel import SequenceParallel

    top: dict[str, ParallelStyle] = {}
    if decoder.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if decoder.norm is not None and isinstance(seq, Shard):
        top["norm"] = SequenceParallel()
    if decoder.output is not None:
        # Loss parallel keeps the logits sharded over the vocabulary; cross entropy then
        # never gathers a [tokens, vocab] tensor.
        top["output"] = ColwiseParallel(
            input_layouts=seq,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if top:
        parallelize_module(decoder, tp_mesh, top)
        # Each style distributed its module's weight on its own; both are Shard(0) (the vocabulary
        # rows), so a tied model keeps one of them for both modules.
        decoder.tie_weights()


def prune_stage(decoder: Decoder, layers: range, first: bool, last: bool) -> None:
    """Keep the blocks in ``layers``, the embedding on the first stage, the final norm and output on the last.

    The stage is still the family's model (the dropped parts are None, the ``layers`` ModuleDict keeps
    the original indices), so its parameter FQNs are those of the whole model.
    """
    for key in list(decoder.layers.keys()):
        if int(key) not in layers:
            del decoder.layers[key]
    if not first:
        decoder.tok_embeddings = None
    if not last:
        decoder.norm = None
        decoder.output = None


def use_attention(decoder: Decoder, choice: str, device_type: str, cp_mesh: DeviceMesh | None,
                  seq_len: int) -> None:
    """Give the decoder the attention backend of this run (``select_backend``: the one place it is chosen).

    On CPU the backend runs the eager-CPU kernels (ops/cpu_kernels.py). Under context parallelism it is
    ``ContextParallel`` (all-gathered K/V, document masks from the whole sequence's positions), and a
    forward that gets no positions is fed the rotary positions of this rank's load-balanced chunks.
    """
    backend = select_backend(choice, decoder.args.attn_mask_type, device_type, cp_mesh=cp_mesh,
                             cpu_kernels=device_type == "cpu")
    decoder.use_attention_backend(backend)
    if cp_mesh is None:
        return
    cp_rank, cp_size = cp_mesh.get_local_rank(), cp_mesh.size()
    cached: dict[torch.device, torch.Tensor] = {}

    def add_positions(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if kwargs.get("positions") is None and len(args) < 2:
            device = decoder.rope_cache.device  # ``module`` is the decoder: the hook is registered on it
            if device not in cached:
                cached[device] = local_positions(seq_len, cp_rank, cp_size, device)
            kwargs = {**kwargs, "positions": cached[device]}
        return args, kwargs

    decoder.register_forward_pre_hook(add_positions, with_kwargs=True)
    logger.info("Applied context parallel on %d ranks (all-gather K/V, load-balanced chunks)", cp_size)


def apply_tp(decoder: Decoder, tp_mesh: DeviceMesh, sequence_parallel: bool, loss_parallel: bool) -> None:
    """Megatron-style TP of the decoder: column-parallel in-projections, row-parallel out-projections.

    With sequence parallelism the activations between the TP regions (norms and residual stream) stay
    sharded along the sequence; the all-reduce of each row-parallel output becomes a reduce-scatter and
    each region's input an all-gather. Without it they stay replicated. Every region's input layout is
    stated, so nothing is replicated by accident. Each region's input becomes one DTensor before its
    projections, so their input gradients (Partial) are summed first and reduced once per region.

    - The attention module gives its own plan (``tp_plan``): grouped-query attention shards its heads
      (gqa.py), MLA its heads with the latent path whole (deepseek_v3/mla.py).
    - Blocks that run after ``layers`` (``extra_blocks``: DeepSeek-V3's MTP modules) take a block's plan, and
      their modules outside the blocks the family's ``extra_tp_plan``.
    - A MoE feed-forward is replicated over TP: its input is gathered to the whole (sequence of the)
      batch, every TP rank routes the same tokens through the same experts, and under SP each keeps
      its sequence shard of the output. Router and experts then see and compute the same values on
      every TP rank, so their gradients are equal there without a collective (docs/moe.md). Where
      expert parallelism borrows TP's ranks (``split_moe_over_tp`` first), each TP rank instead routes
      its own sequence shard (sliced from the replicated input without SP, the output gathered back).
    """
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput, SequenceParallel

    from torchtitan.models.moe import MoE

    seq = Shard(1) if sequence_parallel else Replicate()
    apply_tp_ends(decoder, tp_mesh, seq, loss_parallel)
    extra = decoder.extra_tp_plan(seq)  # what the family adds outside the blocks (DeepSeek-V3's MTP modules)
    if extra:
        parallelize_module(decoder, tp_mesh, extra)
    for block in decoder.blocks() + decoder.extra_blocks():
        # The attention module's own plan (gqa.py, deepseek_v3/mla.py), its names relative to it.
        plan: dict[str, ParallelStyle] = {f"attention.{name}" if name else "attention": style
                                          for name, style in block.attention.tp_plan(seq, tp_mesh).items()}
        # The feed-forward's linears take torchao's FP8 styles where they are tensorwise Float8 (float8_tp.py);
        # the attention module's plan keeps torch's, which a Float8 linear takes like any linear.
        styles = LinearStyles(block, tp_mesh)
        if isinstance(block.feed_forward, MoE):
            # Split over TP (expert parallelism borrowing TP's ranks), the layer takes and gives this rank's
            # sequence shard; otherwise the whole sequence, the same on every TP rank.
            local = Shard(1) if block.feed_forward.tp_split > 1 else Replicate()
            plan["feed_forward"] = PrepareModuleInputOutput(
                input_layouts=(seq,), desired_input_layouts=(local,), use_local_input=True,
                output_layouts=(local,), desired_output_layouts=(seq,), use_local_output=True)
        else:
            plan.update({
                "feed_forward.w1": styles.colwise("feed_forward.w1"),
                "feed_forward.w2": styles.rowwise("feed_forward.w2", output_layouts=seq),
                "feed_forward.w3": styles.colwise("feed_forward.w3"),
                "feed_forward": styles.prepare_input("feed_forward", ("w1", "w3"), input_layouts=(seq,),
                                                   desired_input_layouts=(Replicate(),)),
            })
        if sequence_parallel:
            plan.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()})
        parallelize_module(block, tp_mesh, plan)
    logger.info("Applied tensor parallel on %d ranks (sequence parallel %s, loss parallel %s)", tp_mesh.size(),
                sequence_parallel, loss_parallel)


def apply_ep(model: torch.nn.Module, ep_mesh: DeviceMesh) -> list[torch.nn.Module]:
    """Expert parallelism for every MoE layer of the decoder (or a stage of it): experts ``Shard(0)`` over
    ``ep_mesh``, tokens exchanged by all-to-all. Returns the layers' expert modules, which FSDP then shards
    over ``efsdp`` apart from the rest of their block (distributed/fsdp.py)."""
    from torchtitan.models.moe import MoE
    from torchtitan.models.moe.parallel import apply_expert_parallel, node_hop_groups

    moes = [m for m in model.modules() if isinstance(m, MoE)]
    gpus_per_node = moes[0].args.dispatch_gpus_per_node if moes else 0
    hops = node_hop_groups(ep_mesh.get_group(), gpus_per_node) if gpus_per_node else None
    for moe in moes:
        apply_expert_parallel(moe, ep_mesh, hops)
    logger.info("Applied expert parallel on %d ranks to %d MoE layers (%d experts each, %d per rank)",
                ep_mesh.size(), len(moes), moes[0].args.num_experts if moes else 0,
                moes[0].args.num_experts // ep_mesh.size() if moes else 0)
    return [moe.experts for moe in moes]


def split_moe_over_tp(model: torch.nn.Module, tp_mesh: DeviceMesh) -> None:
    """Each TP rank routes its own tokens through every MoE layer (expert parallelism borrowing TP's ranks);
    before ``apply_tp``, whose plan then gives each layer its rank's sequence shard."""
    from torchtitan.models.moe import MoE
    from torchtitan.models.moe.parallel import split_over_tp

    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        split_over_tp(moe, tp_mesh)


def check_decoder(args: DecoderConfig, tp: int, pp: int, flavor: str, ep: int = 1) -> list[str]:
    """Preflight problems of the decoder against a layout: widths TP must divide, experts EP must divide,
    top_k, tying under PP; one line each."""
    problems: list[str] = []
    moe = args.moe_args() if args.num_experts else None
    if moe is not None and ep > 1 and moe.num_experts % ep:
        problems.append(f"--parallelism.expert_parallel_degree={ep} does not divide the {moe.num_experts} experts "
                        f"of --model.flavor={flavor}; use a degree that divides them (and dp_shard x cp, or "
                        "dp_shard x cp x tp as a multiple of tp)")
    if tp > 1:
        widths = [*args.attention().tp_widths(), ("dim", args.dim)]
        if any(not args.is_moe_layer(i) for i in range(args.n_layers)):
            widths.append(("FFN hidden size", args.dense_ffn_dim()))
        for what, value in widths:
            if value % tp:
                problems.append(f"--parallelism.tensor_parallel_degree={tp}: the model's {what} ({value}) is not "
                                f"divisible by it; pick a degree that divides {what}")
        if args.vocab_size % tp:
            # Padding the vocabulary would change the parameter shapes (and checkpoints) with the layout.
            problems.append(f"--parallelism.tensor_parallel_degree={tp}: vocab size {args.vocab_size} is not divisible "
                            f"by it (the vocabulary is not padded); pick a degree that divides {args.vocab_size}")
    if moe is not None and not 1 <= moe.top_k <= moe.num_experts:
        problems.append(f"--model.flavor={flavor}: top_k={moe.top_k} experts per token exceeds num_experts="
                        f"{moe.num_experts}; use a top_k between 1 and {moe.num_experts}")
    if args.tie_word_embeddings and pp > 1:
        # The embedding and the output live on the first and last stage; nothing keeps two copies equal.
        problems.append(f"--model.flavor={flavor} ties the output projection to the embedding, which pipeline "
                        "parallelism does not support (they live on different stages); use "
                        "--parallelism.pipeline_parallel_degree=1 (FSDP, HSDP, DDP, TP and CP all train it tied)")
    return problems


def check(args: DecoderConfig, dims: ParallelDims, model: job_config.Model, parallelism: job_config.Parallelism
          ) -> list[str]:
    """The model's preflight problems for this job: the layout's (``check_decoder``), and the attention
    backend's capabilities against what the model's attention needs (one line per gap)."""
    problems = check_decoder(args, dims.tp, parallelism.pipeline_parallel_degree, model.flavor, ep=dims.ep)
    needs = args.attention().needs(args.attn_mask_type)
    return problems + backend_problems(model.attention_backend, needs, device_type(), dims.cp > 1)
