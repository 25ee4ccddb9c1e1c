"""A decoder whose feed-forwards may be mixtures of experts: Qwen3, Qwen3-MoE and Mixtral.

Blocks are Llama's (``models/layers.py``: grouped-query attention with rotary positions, SwiGLU)
with two options: Qwen3's query/key norm (an RMSNorm over ``head_dim`` on q and k before the
rotation, ``head_dim`` independent of ``dim``), and a feed-forward that is the shared ``MoE``
(``models/moe``) in the layers ``DecoderArgs.is_moe_layer`` names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from torchtitan.distributed.init_spec import InitSpec, trunc_normal_spec
from torchtitan.models.attention import DocumentMask, check_mask_type
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.kv_cache import LayerCache
from torchtitan.models.layers import Attention, FeedForward, RMSNorm
from torchtitan.models.moe import MoE, MoEArgs
from torchtitan.models.moe.router import check_routing


@dataclass
class DecoderArgs:
    """Hyper-parameters of a (possibly sparse) decoder; Hugging Face's names are in the comments."""

    dim: int = 1024  # hidden_size
    n_layers: int = 28  # num_hidden_layers
    n_heads: int = 16  # num_attention_heads
    n_kv_heads: int = 8  # num_key_value_heads
    head_dim: int = 128  # head_dim (Qwen3: not dim / n_heads in general)
    vocab_size: int = 151936
    ffn_hidden_size: int = 3072  # intermediate_size: the dense layers' SwiGLU width
    norm_eps: float = 1e-6  # rms_norm_eps
    rope_theta: float = 1000000.0
    max_seq_len: int = 4096
    tie_word_embeddings: bool = False
    qk_norm: bool = True  # Qwen3's per-head query/key RMSNorm before RoPE (Mixtral: none)
    # ---- experts (num_experts 0: dense)
    num_experts: int = 0  # num_experts (hub) / num_local_experts (transformers 5, Mixtral)
    top_k: int = 2  # num_experts_per_tok
    moe_hidden_size: int = 0  # moe_intermediate_size (Mixtral: intermediate_size)
    norm_topk_prob: bool = True  # renormalise the chosen experts' softmax weights to sum to one
    mlp_only_layers: tuple[int, ...] = ()  # layers kept dense
    decoder_sparse_step: int = 1  # every step-th layer is sparse (layer i: (i + 1) % step == 0)
    use_grouped_mm: bool = True
    # ---- routing beyond Qwen3-MoE's (DeepSeek-V3 style); the defaults are Qwen3-MoE's and Mixtral's
    score_func: str = "softmax"  # or "sigmoid"
    route_scale: float = 1.0
    num_shared_experts: int = 0
    num_groups: int = 1  # group-limited routing
    topk_groups: int = 1
    # ---- balancing: the job's [moe] section sets these (preflight), not the flavor
    load_balance_coeff: float = 0.0  # > 0: the auxiliary-loss-free routing bias, moved by this much per step
    aux_loss: str = "none"  # none, switch or sequence
    aux_loss_coeff: float = 0.0
    # True: output projections of layer i get std 0.02 / sqrt(2 * (i + 1)); False: 0.02 / sqrt(2 * n_layers).
    depth_init: bool = True
    attn_mask_type: str = "block_causal"  # docs/attention_masks.md

    def __post_init__(self) -> None:
        check_mask_type(self.attn_mask_type)
        self.mlp_only_layers = tuple(self.mlp_only_layers)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.num_experts:
            check_routing(self.num_experts, self.top_k, self.score_func, self.num_groups, self.topk_groups)
            if self.moe_hidden_size < 1 or self.decoder_sparse_step < 1:
                raise ValueError(f"moe_hidden_size={self.moe_hidden_size} and decoder_sparse_step="
                                 f"{self.decoder_sparse_step} must be positive in a model with experts")

    def rope_scaling_params(self) -> None:
        """No frequency scaling in these families (the decoder's rotary cache asks)."""
        return None

    def is_moe_layer(self, i: int) -> bool:
        """Hugging Face's rule: sparse iff not in mlp_only_layers, experts exist, and (i + 1) % step == 0."""
        return i not in self.mlp_only_layers and self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0

    def moe_args(self) -> MoEArgs:
        return MoEArgs(dim=self.dim, hidden_dim=self.moe_hidden_size, num_experts=self.num_experts,
                       top_k=self.top_k, num_shared_experts=self.num_shared_experts,
                       score_func=self.score_func,  # type: ignore[arg-type]  # checked by check_routing
                       norm_topk_prob=self.norm_topk_prob, route_scale=self.route_scale, num_groups=self.num_groups,
                       topk_groups=self.topk_groups, load_balance_bias=self.load_balance_coeff > 0,
                       aux_loss=self.aux_loss,  # type: ignore[arg-type]  # checked by MoEArgs.check
                       aux_loss_coeff=self.aux_loss_coeff, use_grouped_mm=self.use_grouped_mm)


class DecoderBlock(nn.Module):
    """Pre-norm attention, then pre-norm SwiGLU or MoE (named ``feed_forward`` either way)."""

    def __init__(self, layer_id: int, args: DecoderArgs):
        super().__init__()
        self.layer_id = layer_id  # kept so depth-scaled init survives pipeline pruning
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args.dim, args.n_heads, args.n_kv_heads, args.head_dim,
                                   args.norm_eps if args.qk_norm else None)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.moe = args.is_moe_layer(layer_id)
        self.feed_forward: MoE | FeedForward = (MoE(args.moe_args()) if self.moe
                                        else FeedForward(args.dim, args.ffn_hidden_size))

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor, documents: DocumentMask | None = None,
                cache: LayerCache | None = None) -> torch.Tensor:
        # Keywords: tensor parallelism lays out the positional inputs of attention only.
        h = x + self.attention(self.attention_norm(x), rope_cache, documents=documents, cache=cache)
        return h + self.feed_forward(self.ffn_norm(h))


class MoEDecoder(Decoder):
    """``Decoder`` of ``DecoderBlock``: dense, sparse or mixed layers."""

    def __init__(self, args: DecoderArgs):
        super().__init__(args, DecoderBlock)

    def moe_layers(self) -> dict[str, MoE]:
        """Layer key -> its MoE feed-forward (this stage's sparse layers): what balancing and EP go through."""
        return {k: b.feed_forward for k, b in self.layers.items() if isinstance(b.feed_forward, MoE)}

    def param_init_specs(self) -> dict[str, InitSpec]:
        """FQN -> InitSpec, the scheme of Llama 3 (``llama3/model.py``) with the experts' rows alike.

        Norm weights (query/key norms included) ones; in-projections, the router and the experts'
        w1/w3 trunc_normal(0.02, cut at +-2 std); out-projections (wo, w2, the experts' w2) depth-scaled;
        embedding normal(0, 1); output trunc_normal(dim**-0.5, cut at +-3 std). Stacked experts draw
        their full [E, ...] value from (seed, name, shape) like any parameter (layout_init).
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
                for lin in (attn.wq, attn.wk, attn.wv):
                    by_param[id(lin.weight)] = in_spec
                by_param[id(attn.wo.weight)] = out_spec
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
        specs: dict[str, InitSpec] = {}
        for fqn, param in self.named_parameters():
            if id(param) not in by_param:
                raise RuntimeError(f"no init spec for parameter {fqn}")
            specs[fqn] = by_param[id(param)]
        return specs

    @torch.no_grad()
    def init_buffers(self, buffer_device: torch.device | None = None) -> None:
        """The rotary cache, and each MoE's counts (and router bias) zeroed."""
        super().init_buffers(buffer_device)
        for moe in self.moe_layers().values():
            moe.init_buffers()


def param_counts(args: DecoderArgs) -> tuple[int, int]:
    """(total, active per token) parameters, embedding and output included (a tied one once).

    Active counts top_k of the routed experts in each sparse layer, its shared experts, and the router.
    """
    attn = args.dim * args.head_dim * (2 * args.n_heads + 2 * args.n_kv_heads) + 2 * args.dim
    if args.qk_norm:
        attn += 2 * args.head_dim
    dense = 3 * args.dim * args.ffn_hidden_size
    expert = 3 * args.dim * args.moe_hidden_size
    total = active = 0
    for i in range(args.n_layers):
        if args.is_moe_layer(i):
            shared = args.num_shared_experts * expert
            total += attn + args.num_experts * expert + shared + args.dim * args.num_experts
            active += attn + args.top_k * expert + shared + args.dim * args.num_experts
        else:
            total += attn + dense
            active += attn + dense
    ends = args.dim + args.vocab_size * args.dim * (1 if args.tie_word_embeddings else 2)
    return total + ends, active + ends


def flops_per_token(args: DecoderArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6 * N_active + 12 * n_layers * (n_heads * head_dim) * seq_len.

    N_active: the parameters a token's matmuls use (top_k experts of each sparse layer, the router,
    the output projection; not the embedding lookup). The second term is QK^T and AV over the full
    sequence, forward and backward, as Llama 3 counts it (with the attention width n_heads * head_dim).
    """
    _, active = param_counts(args)
    n = active - args.vocab_size * args.dim  # the lookup does no matmul; a tied output still does
    if args.tie_word_embeddings:
        n += args.vocab_size * args.dim
    return 6.0 * n + 12.0 * args.n_layers * args.n_heads * args.head_dim * seq_len
