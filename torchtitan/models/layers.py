"""Building blocks shared by the model families: RMSNorm, rotary embeddings, the SwiGLU feed-forward.

The attention modules are in ``models/attention`` (``gqa.py``), built on these.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn


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


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)  # gate
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)  # down projection
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)  # up projection

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
