"""The one decoder-only transformer of every family: embedding, blocks, final norm, output.

A family is a configuration of it (``config.DecoderConfig``): each block is pre-norm attention (the
module ``args.attention()`` builds: grouped-query, with or without QK-norm) and a pre-norm feed-forward,
SwiGLU or the shared ``MoE`` in the layers ``args.is_moe_layer`` names. Llama 3, Qwen3, Qwen3-MoE and
Mixtral differ only in their arguments.

Written to be easy to parallelise:
- ``layers`` is a ModuleDict keyed by the original layer index, and the embedding, final norm and
  output projection may be None, so pipeline stages can prune the model and still keep the
  original parameter names;
- initialisation is described by ``param_init_specs()`` (one spec per parameter), the single source
  of truth for both plain and sharded initialisation;
- attention's kernels are one backend object (``models/attention/backends.py``) that the decoder
  holds and passes to every block in its forward; ``use_attention_backend`` is where a run's choice
  (``select_backend``) lands;
- with an auxiliary balance loss on its MoE layers, a training forward returns ``(logits, summed loss)``
  (a forward hook, ``models/aux_loss.py``; the hidden states and the running sum on a pipeline stage
  without the output).

The class is also what the rest of the code asks of a family (``ModelSpec.model``, docs/models.md): its FLOPs,
checks and job options from args alone (classmethods), and its TP plan, attention backend, pipeline pruning
and expert parallelism (methods). The shared behaviour is here, its bodies in ``parallel.py``, ``flops.py``
and ``models/moe``; a family's subclass overrides what differs (DeepSeek-V3, GPT-OSS).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, NamedTuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from torchtitan.config import job_config
from torchtitan.distributed.init_spec import InitSpec, apply_init_spec, trunc_normal_spec
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.attention import (
    AttentionBackend,
    DocumentMask,
    GroupedQueryAttention,
    decoding_backend,
    select_backend,
)
from torchtitan.models.aux_loss import return_aux_losses
from torchtitan.models.common import flops, parallel
from torchtitan.models.common.args import MoEDecoderArgs
from torchtitan.models.common.config import AttentionModule, DecoderConfig
from torchtitan.models.expert_balance import ExpertLayer
from torchtitan.models.kv_cache import KVCache, LayerCache
from torchtitan.models.layers import FeedForward, RMSNorm, precompute_rope_cache
from torchtitan.models.moe import MoE
from torchtitan.models.moe import moe_layers as moe_modules
from torchtitan.models.moe.assumed import assume_routing

DEFAULT_LOAD_BALANCE_COEFF = 1e-3  # DeepSeek-V3's bias update speed (its report's gamma)


class DecoderBlock(nn.Module):
    """Pre-norm attention, then pre-norm SwiGLU or MoE (named ``feed_forward`` either way)."""

    def __init__(self, layer_id: int, args: DecoderConfig):
        super().__init__()
        self.layer_id = layer_id  # kept so depth-scaled init survives pipeline pruning
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention: AttentionModule = self.build_attention(layer_id, args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.moe = args.is_moe_layer(layer_id)
        self.feed_forward: MoE | FeedForward = (self.build_moe(args) if self.moe
                                                else FeedForward(args.dim, args.dense_ffn_dim()))

    def build_attention(self, layer_id: int, args: DecoderConfig) -> AttentionModule:
        """The attention module of this layer: the one ``args.attention()`` describes (GPT-OSS's differs by
        layer, its window)."""
        return args.attention().build()

    def build_moe(self, args: DecoderConfig) -> MoE:
        """The sparse feed-forward: the shared ``MoE`` (GPT-OSS's has its own experts)."""
        return MoE(args.moe_args())

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor, *, backend: AttentionBackend,
                documents: DocumentMask | None = None, cache: LayerCache | None = None) -> torch.Tensor:
        # Keywords: tensor parallelism lays out the positional inputs of attention only.
        h = x + self.attention(self.attention_norm(x), rope_cache, backend=backend, documents=documents, cache=cache)
        return h + self.feed_forward(self.ffn_norm(h))


class BlocksRun(NamedTuple):
    """What a forward through ``layers`` leaves: the hidden states and what the blocks were given, for blocks
    that run after them (DeepSeek-V3's multi-token prediction)."""

    hidden: torch.Tensor
    rope: torch.Tensor
    backend: AttentionBackend
    documents: DocumentMask | None


class Decoder(nn.Module):
    """Embedding -> blocks (``layers``) -> final norm -> output projection; see the module docstring."""

    block_type: type[DecoderBlock] = DecoderBlock  # a family with its own block subclasses it (GPT-OSS)
    # generation (torchtitan/generation): the forward takes ``cache=`` a ``models/kv_cache.KVCache`` (new tokens
    # only, positions and mask from the cache)
    supports_kv_cache: ClassVar[bool] = True
    rope_cache: torch.Tensor  # a buffer (registered in __init__): nn.Module's stubs type attributes as Tensor | Module
    # whether the family's Hugging Face format has a place for the auxiliary-loss-free routing bias (DeepSeek-V3's
    # e_score_correction_bias): the bias is then its default balancing, else off by default and an export of a
    # model trained with it is refused (checkpoint/formats.export_hf)
    release_holds_routing_bias: ClassVar[bool] = False

    def __init__(self, args: DecoderConfig):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): self.block_type(i, args) for i in range(args.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(args.dim, args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()
        # True on a pipeline stage past the first that keeps the embedding (DeepSeek-V3's last stage, whose
        # multi-token prediction reads it): its input is the previous stage's hidden states all the same.
        self.input_is_hidden = False
        # None until a run selects one (use_attention_backend): the forward then takes the local default
        # for its inputs' device.
        self.attention_backend: AttentionBackend | None = None
        # Non-persistent: it is derived from args, so it stays out of checkpoints.
        self.register_buffer("rope_cache", self._rope_cache(device=None), persistent=False)
        # (From the blocks: a subclass's moe_layers may read modules it adds after this.)
        if any(isinstance(b.feed_forward, MoE) and b.feed_forward.has_aux_loss for b in self.blocks()):
            return_aux_losses(self, self.moe_layers)

    def tie_weights(self) -> None:
        """With ``tie_word_embeddings``, make the output projection's weight the embedding's (one parameter).

        Called again wherever a step may have given the two modules separate copies: tensor
        parallelism distributes each module's weight on its own, and ``to_empty`` of plain
        tensors allocates per module. Both modules shard the vocabulary dim (rows) under TP,
        so the embedding's placement serves the output too. A pipeline stage holding only
        one of them has nothing to tie.
        """
        if self.args.tie_word_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def to_empty(self, *, device: torch.device | str | None, recurse: bool = True) -> Decoder:
        super().to_empty(device=device, recurse=recurse)
        self.tie_weights()
        return self

    def _rope_cache(self, device: torch.device | None) -> torch.Tensor:
        a = self.args
        return precompute_rope_cache(a.head_dim, a.max_seq_len, a.rope_theta, a.rope_scaling_params(), device)

    def blocks(self) -> list[DecoderBlock]:
        return [b for b in self.layers.values() if isinstance(b, DecoderBlock)]

    def extra_blocks(self) -> list[DecoderBlock]:
        """Blocks that run after ``layers`` (DeepSeek-V3's MTP modules'): FSDP units and TP plans of their own,
        as the blocks'. None here."""
        return []

    def extra_tp_plan(self, seq: Shard | Replicate) -> dict[str, ParallelStyle]:
        """The TP plan (names relative to the model) of modules a family adds outside the blocks, for the
        layout ``seq`` of the activations between TP regions (``Shard(1)`` under sequence parallelism). None."""
        return {}

    def moe_layers(self) -> dict[str, MoE]:
        """Layer key -> its MoE feed-forward (this stage's sparse layers): what balancing and EP go through."""
        return {k: b.feed_forward for k, b in self.layers.items() if isinstance(b.feed_forward, MoE)}

    # ---------------------------------------------------------------- init

    def param_init_specs(self) -> dict[str, InitSpec]:
        """FQN -> InitSpec for every parameter of this (possibly pruned) model.

        Norm weights (query/key norms included) ones; attention's in-projections, w1/w3, the router and
        the experts' w1/w3 trunc_normal(0.02, cut at +-2 std); out-projections (wo, w2, the experts' w2)
        trunc_normal(cut at +-2 std) with std 0.02 / sqrt(2 * (layer_id + 1)) if depth_init else
        0.02 / sqrt(2 * n_layers); embedding normal(0, 1); output trunc_normal(dim**-0.5, cut at +-3 std).
        A tied embedding/output takes the output's rule: it sets the scale of the logits, while the first
        norm rescales whatever the embedding holds. Stacked experts draw their full [E, ...] value from
        (seed, name, shape) like any parameter (layout_init). Specs are attached by parameter identity
        and named through named_parameters(), so wrappers (FSDP, activation checkpointing) keep working.
        """
        args = self.args
        by_param: dict[int, InitSpec] = {}
        for module in self.modules():
            if isinstance(module, RMSNorm):
                by_param[id(module.weight)] = InitSpec("ones")
            elif isinstance(module, DecoderBlock):
                depth = module.layer_id + 1 if args.depth_init else args.n_layers
                out_std = 0.02 / math.sqrt(2 * depth)
                in_spec, out_spec = trunc_normal_spec(0.02, 2.0), trunc_normal_spec(out_std, 2.0)
                attn, ffn = module.attention, module.feed_forward
                for lin in attn.in_projections():
                    by_param[id(lin.weight)] = in_spec
                for lin in attn.out_projections():
                    by_param[id(lin.weight)] = out_spec
                if isinstance(ffn, MoE):
                    for name, spec in ffn.param_init_specs(0.02, out_std).items():
                        by_param[id(ffn.get_parameter(name))] = spec
                else:
                    by_param[id(ffn.w1.weight)] = by_param[id(ffn.w3.weight)] = in_spec
                    by_param[id(ffn.w2.weight)] = out_spec
        if self.tok_embeddings is not None:
            by_param[id(self.tok_embeddings.weight)] = InitSpec("normal", std=1.0)
        if self.output is not None:  # after the embedding: a tied weight takes the output's rule
            by_param[id(self.output.weight)] = trunc_normal_spec(args.dim**-0.5, 3.0)
        by_param.update(self.extra_init_specs())
        specs: dict[str, InitSpec] = {}
        for fqn, param in self.named_parameters():
            if id(param) not in by_param:
                raise RuntimeError(f"no init spec for parameter {fqn}")
            specs[fqn] = by_param[id(param)]
        return specs

    def extra_init_specs(self) -> dict[int, InitSpec]:
        """id(parameter) -> InitSpec of parameters outside the blocks, norms, embedding and output that a
        subclass adds (DeepSeek-V3's MTP projections); none here."""
        return {}

    @torch.no_grad()
    def init_buffers(self, buffer_device: torch.device | None = None) -> None:
        """Recompute the (non-persistent) rope cache, e.g. after ``to_empty``; zero each MoE's counts (and bias)."""
        device = buffer_device if buffer_device is not None else self.rope_cache.device
        self.rope_cache = self._rope_cache(device)
        for moe in self.moe_layers().values():
            moe.init_buffers()

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Recompute the buffers, then fill every parameter from param_init_specs()."""
        self.init_buffers(buffer_device)
        specs = self.param_init_specs()
        for fqn, param in self.named_parameters():
            apply_init_spec(param, specs[fqn])

    # ---------------------------------------------------------------- forward

    def use_attention_backend(self, backend: AttentionBackend) -> None:
        """The backend every block's attention and each forward's document mask go through (a run's
        choice, ``select_backend``; context parallelism's is ``ContextParallel``)."""
        self.attention_backend = backend

    def backend_for(self, device: torch.device) -> AttentionBackend:
        """The selected backend, or the local default for ``device`` when no run selected one."""
        if self.attention_backend is not None:
            return self.attention_backend
        return select_backend("auto", self.args.attn_mask_type, device.type)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        """tokens: ids [B, L] (or hidden states [B, L, dim] on a stage without embeddings).

        positions: [L] or [B, L] indices into the rope cache; None means 0..L-1. Under the
        ``block_causal`` mask they also delimit the documents: each restarts at 0 at a
        document's first token (None: every row is one document).
        cache: decoding (models/kv_cache.py): ``tokens`` are the rows' next tokens after those the
        cache holds, which gives their positions and mask; training never passes one.
        Returns logits [B, L, vocab] (hidden states on a stage without output).
        """
        if cache is not None:
            return self._forward_cached(tokens, cache)
        return self._head(self.run_blocks(tokens, positions).hidden)

    def run_blocks(self, tokens: torch.Tensor, positions: torch.Tensor | None) -> BlocksRun:
        """The stage's input embedded (token ids) or taken as it is (hidden states), then through ``layers``."""
        backend = self.backend_for(tokens.device)
        h = self.embed_input(tokens)
        # Attention slices the cache to its own length: under sequence parallelism h holds only
        # part of the sequence here, while attention sees all of it.
        rope = self.rope_cache if positions is None else self.rope_cache[positions]
        documents = None
        if self.args.attn_mask_type == "block_causal" and positions is not None:
            documents = backend.document_mask(positions, tokens.shape[0])  # once per forward, shared by the layers
        for layer in self.layers.values():
            h = layer(h, rope, backend=backend, documents=documents)
        return BlocksRun(h, rope, backend, documents)

    def embed_input(self, tokens: torch.Tensor) -> torch.Tensor:
        """The embedding of ``tokens`` (ids) where this model or stage embeds its input; else ``tokens`` are
        hidden states already (a later pipeline stage, which may still hold a copy of the embedding for
        another use: ``input_is_hidden``)."""
        if self.tok_embeddings is None or self.input_is_hidden:
            return tokens
        return self.tok_embeddings(tokens)

    def _forward_cached(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One decoding forward: the new tokens attend to the cache's keys; each layer appends its own."""
        backend = decoding_backend(self.backend_for(tokens.device))
        h = self.embed_input(tokens)
        rope = self.rope_cache[cache.begin(tokens.shape[1])]
        for key, layer in self.layers.items():
            h = layer(h, rope, backend=backend, cache=cache.layer(key))
        cache.advance(tokens.shape[1])
        return self._head(h)

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h

    # ---------------------------------------------------------------- the family's seam, from args alone

    @classmethod
    def flops_per_token(cls, args: DecoderConfig, seq_len: int) -> float:
        """Training FLOPs per token of the model ``args`` describes, at ``seq_len`` (``flops.py``)."""
        return flops.flops_per_token(args, seq_len)

    @classmethod
    def hidden_width(cls, args: DecoderConfig) -> int:
        """The width of the hidden state that flows between pipeline stages [micro-batch, seq, width]."""
        return args.dim  # the residual stream

    @classmethod
    def check(cls, args: DecoderConfig, dims: ParallelDims, model: job_config.Model,
              parallelism: job_config.Parallelism) -> list[str]:
        """Preflight problems of the model in this layout (widths TP must divide, experts EP must divide, the
        attention backend), one line each."""
        return parallel.check(args, dims, model, parallelism)

    @classmethod
    def default_load_balance_coeff(cls) -> float:
        """``--moe.load_balance_coeff`` when unset: the bias only where the release format can hold it."""
        return DEFAULT_LOAD_BALANCE_COEFF if cls.release_holds_routing_bias else 0.0

    @classmethod
    def with_job_options(cls, args: DecoderConfig, model: job_config.Model, moe: job_config.Moe) -> DecoderConfig:
        """``args`` with the job's options applied: the [moe] balancing, all-to-all overlap and two-hop dispatch of a
        model with experts (``--moe.overlap_all_to_all`` and ``--moe.dispatch_gpus_per_node`` reach each MoE layer
        through ``moe_args``)."""
        if not isinstance(args, MoEDecoderArgs) or not args.num_experts:
            return args
        return dataclasses.replace(args, load_balance_coeff=moe.load_balance_coeff or 0.0, aux_loss=moe.aux_loss,
                                   aux_loss_coeff=moe.aux_loss_coeff if moe.aux_loss != "none" else 0.0,
                                   overlap_all_to_all=moe.overlap_all_to_all,
                                   dispatch_gpus_per_node=moe.dispatch_gpus_per_node)

    # ---------------------------------------------------------------- the family's seam, on a model part

    def apply_tp(self, tp_mesh: DeviceMesh, sequence_parallel: bool, loss_parallel: bool) -> None:
        """The tensor-parallel plan (``parallel.apply_tp``)."""
        parallel.apply_tp(self, tp_mesh, sequence_parallel, loss_parallel)

    def use_attention(self, choice: str, device_type: str, cp_mesh: DeviceMesh | None, seq_len: int) -> None:
        """Select the run's attention backend (``--model.attention_backend``; context parallelism's with
        ``cp_mesh``)."""
        parallel.use_attention(self, choice, device_type, cp_mesh, seq_len)

    def prune_stage(self, layers: range, first: bool, last: bool) -> None:
        """Make this copy of the whole model a pipeline stage keeping ``layers`` (in place)."""
        parallel.prune_stage(self, layers, first, last)

    def split_moe_over_tp(self, tp_mesh: DeviceMesh) -> None:
        """Each TP rank routes its own tokens through the MoE layers (expert parallelism borrowing TP's ranks;
        before ``apply_tp``)."""
        parallel.split_moe_over_tp(self, tp_mesh)

    def apply_ep(self, ep_mesh: DeviceMesh) -> list[nn.Module]:
        """Shard each MoE layer's experts over ``ep_mesh``; the expert modules (FSDP shards each over ``efsdp``)."""
        return parallel.apply_ep(self, ep_mesh)

    def expert_layers(self) -> list[ExpertLayer]:
        """The MoE layers of this part, which the trainer balances and logs (train_step/experts.py)."""
        return moe_modules(self)  # every MoE module of the part, in module order

    def assume_routing(self, imbalance: float) -> int:
        """The planner's dry run: the MoE layers made to assume their token counts (which fake tensors do not
        hold), with the simulated rank's ``imbalance``; how many."""
        return assume_routing(self, imbalance)

    def mtp_objective(self) -> tuple[int, float]:
        """(depths, loss weight) of the model's multi-token prediction; depths 0: none."""
        return 0, 0.0

    def fused_row_parts(self) -> dict[torch.Tensor, tuple[int, ...]]:
        """Weights whose rows stack several projections, each part's row count: a matrix optimizer (Muon)
        orthogonalizes each part alone. The shared decoder fuses none."""
        return {}

    def head_row_parts(self) -> dict[torch.Tensor, tuple[int, ...]]:
        """The attention's query, key and value weights, each split into its heads' rows (``head_dim`` each):
        Muon's ``--optimizer.muon_split_heads`` orthogonalizes each head's map alone. Grouped-query attention
        (sink attention's too): ``wq`` has ``n_heads`` parts, ``wk`` and ``wv`` ``n_kv_heads``."""
        parts: dict[torch.Tensor, tuple[int, ...]] = {}
        for module in self.modules():
            if isinstance(module, GroupedQueryAttention):
                for linear in (module.wq, module.wk, module.wv):
                    # the global shape, a DTensor's too: the owner orthogonalizes the whole weight
                    heads = linear.weight.shape[0] // module.head_dim
                    parts[linear.weight] = (module.head_dim,) * heads
        return parts

    def num_params(self, exclude_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())  # a tied weight is counted once
        if exclude_embedding and self.tok_embeddings is not None:
            n -= self.tok_embeddings.weight.numel()
        return n
