"""The Llama 3 transformer: pre-norm blocks of grouped-query attention and SwiGLU.

Written to be easy to parallelise:
- attention derives its (local) head count from tensor shapes, so it keeps working
  when tensor parallelism shards wq/wk/wv by columns;
- `layers` is a ModuleDict keyed by the original layer index, and the embedding,
  final norm and output projection may be None, so pipeline stages can prune the
  model and still keep the original parameter names;
- initialisation is described by `param_init_specs()` (one spec per parameter), the
  single source of truth for both plain and sharded initialisation.
"""

import math

import torch
from torch import nn

from torchtitan.distributed.init_spec import InitSpec, apply_init_spec, trunc_normal_spec  # noqa: F401 - re-exported
from torchtitan.models import layers
from torchtitan.models.attention import DocumentMask
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.kv_cache import LayerCache
from torchtitan.models.layers import (  # noqa: F401 - re-exported: Llama 3's blocks live in models/layers.py
    FeedForward,
    RMSNorm,
    apply_rotary_emb,
    precompute_rope_cache,
    repeat_kv,
    rope_frequencies,
    rotate_pairs,
)
from torchtitan.models.llama3.args import ModelArgs

# ---------------------------------------------------------------- building blocks (models/layers.py)


class Attention(layers.Attention):
    """Llama 3's attention: grouped-query, head_dim = dim / n_heads, no query/key norm."""

    def __init__(self, args: ModelArgs):
        super().__init__(args.dim, args.n_heads, args.n_kv_heads or args.n_heads, args.head_dim)


def ffn_hidden_dim(args: ModelArgs) -> int:
    """SwiGLU width: as the release states it (``ffn_hidden_size``), else 2/3 of 4*dim (keeps
    params equal to a 4x GELU MLP), optionally scaled, then rounded up to a multiple of `multiple_of`."""
    if args.ffn_hidden_size is not None:
        return args.ffn_hidden_size
    hidden = int(2 * (4 * args.dim) / 3)
    if args.ffn_dim_multiplier is not None:
        hidden = int(args.ffn_dim_multiplier * hidden)
    return args.multiple_of * ((hidden + args.multiple_of - 1) // args.multiple_of)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id  # kept so depth-scaled init survives pipeline pruning
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, ffn_hidden_dim(args))

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor, documents: DocumentMask | None = None,
                cache: LayerCache | None = None) -> torch.Tensor:
        # Keywords: tensor parallelism lays out the positional inputs of attention only.
        h = x + self.attention(self.attention_norm(x), rope_cache, documents=documents, cache=cache)
        return h + self.feed_forward(self.ffn_norm(h))


# ---------------------------------------------------------------- the model


class Transformer(Decoder):
    """Llama 3: ``Decoder`` of ``TransformerBlock`` (grouped-query attention and SwiGLU)."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, TransformerBlock)

    def param_init_specs(self) -> dict[str, InitSpec]:
        """FQN -> InitSpec for every parameter of this (possibly pruned) model.

        Scheme: embeddings normal(0, 1); norm weights ones; wq/wk/wv/w1/w3
        trunc_normal(std 0.02, cut at +-2 std); wo/w2 trunc_normal(cut at +-2 std) with
        std 0.02 / sqrt(2 * (layer_id + 1)) if depth_init else 0.02 / sqrt(2 * n_layers);
        output trunc_normal(std dim**-0.5, cut at +-3 std). A tied embedding/output takes the
        output's rule: it sets the scale of the logits, while the first norm rescales whatever
        the embedding holds.
        Specs are attached by parameter identity and then named through
        named_parameters(), so wrappers (FSDP, activation checkpointing) keep working.
        """
        args = self.args
        by_param: dict[int, InitSpec] = {}
        for module in self.modules():
            if isinstance(module, RMSNorm):
                by_param[id(module.weight)] = InitSpec("ones")
            elif isinstance(module, TransformerBlock):
                depth = module.layer_id + 1 if args.depth_init else args.n_layers
                out_spec = trunc_normal_spec(0.02 / math.sqrt(2 * depth), 2.0)
                in_spec = trunc_normal_spec(0.02, 2.0)
                attn, ffn = module.attention, module.feed_forward
                for lin in (attn.wq, attn.wk, attn.wv, ffn.w1, ffn.w3):
                    by_param[id(lin.weight)] = in_spec
                for lin in (attn.wo, ffn.w2):
                    by_param[id(lin.weight)] = out_spec
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

def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6 * N + 12 * n_layers * dim * seq_len.

    N counts non-embedding parameters (the lookup does no matmul; the output
    projection does and is included). 6N covers forward (2N) and backward (4N) of
    the matmuls; the second term is QK^T and AV over the full sequence, forward and
    backward, without halving for the causal mask (the common convention).
    """
    hd, n_kv = args.head_dim, args.n_kv_heads or args.n_heads
    attn = args.dim * hd * (2 * args.n_heads + 2 * n_kv)
    ffn = 3 * args.dim * ffn_hidden_dim(args)
    per_layer = attn + ffn + 2 * args.dim
    n = args.n_layers * per_layer + args.dim + args.dim * args.vocab_size
    return 6.0 * n + 12.0 * args.n_layers * args.dim * seq_len
