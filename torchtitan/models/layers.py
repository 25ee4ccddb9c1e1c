"""Building blocks shared by the model families: RMSNorm, rotary embeddings, grouped-query attention
(optionally with per-head query/key norms), the SwiGLU feed-forward.

They were Llama 3's; families that reuse them (Qwen3, Mixtral) import them from here, so no family
imports another.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.attention import AttentionBackend, DocumentMask, block_causal_attention
from torchtitan.models.kv_cache import LayerCache


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
    """Grouped-query attention with rotary positions.

    ``qk_norm_eps``: Qwen3's query/key norm, an RMSNorm over each head's ``head_dim`` applied to q and
    k before the rotation (None: none, as Llama). ``head_dim`` need not be ``dim / n_heads``. ``bias``: the
    four projections have biases (GPT-OSS).
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, qk_norm_eps: float | None = None,
                 bias: bool = False):
        super().__init__()
        self.head_dim = head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=bias)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=bias)
        self.q_norm: RMSNorm | None = None if qk_norm_eps is None else RMSNorm(head_dim, qk_norm_eps)
        self.k_norm: RMSNorm | None = None if qk_norm_eps is None else RMSNorm(head_dim, qk_norm_eps)
        # None: this layer's own kernels (``sdpa``, ``masked_sdpa``); context parallelism sets its backend
        # (models/attention.py) through the model's ``use_attention_backend``.
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
        """``cache``: decoding (models/kv_cache.py) appends this forward's keys and values to it and
        attends to all it holds; training passes none and runs the branches below it."""
        bs, seqlen, _ = x.shape
        # -1 instead of n_heads: under tensor parallelism these are the local heads.
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # per head, before the rotation (Qwen3): both or none
            xq, xk = self.q_norm(xq), self.k_norm(xk)
        xq, xk = self.rotary(xq, xk, rope_cache[..., :seqlen, :])
        q, k, v = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        if cache is not None:
            out = self.cached_sdpa(q, k, v, cache)
        elif self.backend is not None:
            out = self.backend.causal(q, k, v) if documents is None else self.backend.block_causal(q, k, v, documents)
        else:
            out = self.sdpa(q, k, v) if documents is None else self.masked_sdpa(q, k, v, documents)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)  # gate
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)  # down projection
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)  # up projection

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


