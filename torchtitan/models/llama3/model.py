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
import torch.nn.functional as F
from torch import nn

from torchtitan.distributed.init_spec import InitSpec, apply_init_spec, trunc_normal_spec
from torchtitan.models.attention import AttentionBackend, DocumentMask, block_causal_attention, build_document_mask
from torchtitan.models.kv_cache import KVCache, LayerCache
from torchtitan.models.llama3.args import ModelArgs

# ---------------------------------------------------------------- building blocks


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(F, "rms_norm"):
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Fallback for old torch: normalise in float32 so bf16 inputs keep precision.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rope_frequencies(head_dim: int, theta: float, scaling: dict[str, float] | None = None) -> torch.Tensor:
    """Per-pair rotation frequencies theta_i = theta^(-2i/head_dim), float64.

    ``scaling`` (``ModelArgs.rope_scaling_params()``) applies the Llama 3.1 rule: low
    frequencies (wavelength above original_context / low_freq_factor) are slowed down by
    ``factor``, high frequencies (wavelength below original_context / high_freq_factor)
    are kept, and the band in between is blended linearly.
    """
    freqs = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if not scaling:
        return freqs
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = float(scaling["original_context"])
    wavelen = 2 * math.pi / freqs
    smooth = (old_context / wavelen - low) / (high - low)
    blended = (1 - smooth) * freqs / factor + smooth * freqs
    out = torch.where(wavelen > old_context / low, freqs / factor, blended)
    return torch.where(wavelen < old_context / high, freqs, out)


def precompute_rope_cache(
    head_dim: int, max_seq_len: int, theta: float, scaling: dict[str, float] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Real-valued rotary cache of shape [max_seq_len, head_dim], float32.

    Row p is cat(cos(p * theta_i), sin(p * theta_i)) for i in 0..head_dim/2-1, i.e. the
    first half holds cosines and the second half sines. Angles are computed in float64
    because p * theta_i loses several bits in float32 at long context.
    """
    freqs = rope_frequencies(head_dim, theta, scaling).to(device)
    pos = torch.arange(max_seq_len, dtype=torch.float64, device=device)
    angles = torch.outer(pos, freqs)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


def apply_rotary_emb(
    xq: torch.Tensor, xk: torch.Tensor, rope_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query/key heads. x*: [B, L, H, head_dim]; rope_cache: [L, head_dim] or [B, L, head_dim].

    Uses the Meta reference convention: adjacent pairs (x[2i], x[2i+1]) rotate by
    angle p * theta_i, so published checkpoints load without permuting wq/wk.
    """
    cos, sin = rope_cache.unsqueeze(-2).chunk(2, dim=-1)  # [..., L, 1, head_dim/2], broadcasts over heads
    return rotate_pairs(xq, cos, sin), rotate_pairs(xk, cos, sin)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """(x[2i], x[2i+1]) -> (x0 cos - x1 sin, x0 sin + x1 cos), in float32, back to x's dtype."""
    pairs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return out.flatten(-2).type_as(x)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, H_kv, L, D] -> [B, H_kv * n_rep, L, D], each KV head repeated for its query group.

    Done explicitly (rather than SDPA's enable_gqa) because not every attention
    backend supports enable_gqa.
    """
    if n_rep == 1:
        return x
    bs, n_kv, seqlen, head_dim = x.shape
    return x[:, :, None].expand(bs, n_kv, n_rep, seqlen, head_dim).reshape(bs, n_kv * n_rep, seqlen, head_dim)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        n_kv_heads = args.n_kv_heads or args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        # None: this layer's own kernels (``sdpa``, ``masked_sdpa``); context parallelism sets its backend
        # (models/attention.py) through ``Transformer.use_attention_backend``.
        self.backend: AttentionBackend | None = None

    def rotary(self, xq: torch.Tensor, xk: torch.Tensor, rope_cache: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate the query and key heads (``apply_rotary_emb``); a CPU kernel may stand in (ops/cpu_kernels.py)."""
        return apply_rotary_emb(xq, xk, rope_cache)

    def sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention: q [B, H, L, D]; k, v [B, H_kv, L, D] (grouped-query heads).

        On CPU a grouped-query kernel may stand in (ops/cpu_kernels.py).
        """
        n_rep = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), is_causal=True)

    def masked_sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: DocumentMask) -> torch.Tensor:
        """Document-masked attention of whole sequences (models/attention.py)."""
        return block_causal_attention(q, k, v, documents)

    def cached_sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerCache) -> torch.Tensor:
        """Decoding: the new tokens' queries against every cached key (the cache's padding and causal mask)."""
        k, v = cache.update(k, v)
        n_rep = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), attn_mask=cache.mask)

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor, documents: DocumentMask | None = None,
                cache: LayerCache | None = None) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        # -1 instead of n_heads: under tensor parallelism these are the local heads.
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = self.rotary(xq, xk, rope_cache[..., :seqlen, :])
        q, k, v = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        if cache is not None:
            out = self.cached_sdpa(q, k, v, cache)
        elif self.backend is not None:
            out = self.backend.causal(q, k, v) if documents is None else self.backend.block_causal(q, k, v, documents)
        else:
            out = self.sdpa(q, k, v) if documents is None else self.masked_sdpa(q, k, v, documents)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


def ffn_hidden_dim(args: ModelArgs) -> int:
    """SwiGLU width: as the release states it (``ffn_hidden_size``), else 2/3 of 4*dim (keeps
    params equal to a 4x GELU MLP), optionally scaled, then rounded up to a multiple of `multiple_of`."""
    if args.ffn_hidden_size is not None:
        return args.ffn_hidden_size
    hidden = int(2 * (4 * args.dim) / 3)
    if args.ffn_dim_multiplier is not None:
        hidden = int(args.ffn_dim_multiplier * hidden)
    return args.multiple_of * ((hidden + args.multiple_of - 1) // args.multiple_of)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)  # gate
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)  # down projection
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)  # up projection

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


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


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(args.dim, args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()
        self.attention_backend: AttentionBackend | None = None  # see use_attention_backend
        # Non-persistent: it is derived from args, so it stays out of checkpoints.
        self.register_buffer("rope_cache", self._rope_cache(device=None), persistent=False)

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

    def to_empty(self, *, device: torch.device | str | None, recurse: bool = True) -> "Transformer":
        super().to_empty(device=device, recurse=recurse)
        self.tie_weights()
        return self

    def _rope_cache(self, device: torch.device | None) -> torch.Tensor:
        a = self.args
        return precompute_rope_cache(a.head_dim, a.max_seq_len, a.rope_theta, a.rope_scaling_params(), device)

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

    @torch.no_grad()
    def init_buffers(self, buffer_device: torch.device | None = None) -> None:
        """Recompute the (non-persistent) rope cache, e.g. after ``to_empty``."""
        device = buffer_device if buffer_device is not None else self.rope_cache.device
        self.rope_cache = self._rope_cache(device)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Recompute the rope cache, then fill every parameter from param_init_specs()."""
        self.init_buffers(buffer_device)
        specs = self.param_init_specs()
        for fqn, param in self.named_parameters():
            apply_init_spec(param, specs[fqn])

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
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        # Attention slices the cache to its own length: under sequence parallelism h holds only
        # part of the sequence here, while attention sees all of it.
        rope = self.rope_cache if positions is None else self.rope_cache[positions]
        documents = None
        if self.args.attn_mask_type == "block_causal" and positions is not None:
            documents = self.document_mask(positions, tokens.shape[0])  # once per forward, shared by the layers
        for layer in self.layers.values():
            h = layer(h, rope, documents=documents)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h

    def _forward_cached(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One decoding forward: the new tokens attend to the cache's keys; each layer appends its own."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        rope = self.rope_cache[cache.begin(tokens.shape[1])]
        for key, layer in self.layers.items():
            h = layer(h, rope, cache=cache.layer(key))
        cache.advance(tokens.shape[1])
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h

    def use_attention_backend(self, backend: AttentionBackend) -> None:
        """Make every attention layer, and the document mask of each forward, go through ``backend``
        (context parallelism selects ``ContextParallelAttention``)."""
        self.attention_backend = backend
        for layer in self.layers.values():
            layer.attention.backend = backend

    def document_mask(self, positions: torch.Tensor, batch: int) -> DocumentMask:
        """The documents of this forward's rows: of the whole sequence under an attention backend."""
        if self.attention_backend is not None:
            return self.attention_backend.document_mask(positions, batch)
        return build_document_mask(positions, batch)

    def num_params(self, exclude_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())  # a tied weight is counted once
        if exclude_embedding and self.tok_embeddings is not None:
            n -= self.tok_embeddings.weight.numel()
        return n


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
