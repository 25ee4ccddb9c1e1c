"""Building blocks shared by the model families: RMSNorm, rotary embeddings, the SwiGLU feed-forward.

The attention modules are in ``models/attention`` (``gqa.py``), built on these.
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass

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


def _json_number(params: Mapping[str, object], key: str) -> float | None:
    """``params[key]`` as a float (a JSON number, or a string of one); None where it is absent or null."""
    value = params.get(key)
    if value is None:
        return None
    if not isinstance(value, (int, float, str)):
        raise ValueError(f"rope scaling {key}={value!r}: a number is expected; fix it in the release's config.json")
    return float(value)


@dataclass(frozen=True)
class YarnScaling:
    """YaRN rotary scaling (Peng et al. 2023, "YaRN: Efficient Context Window Extension"), as DeepSeek-V3,
    Kimi K2 and GPT-OSS release it in ``rope_scaling`` / ``rope_parameters`` (``rope_type: yarn``).

    Frequencies: each pair i keeps its base frequency (extrapolation) when it turns more than
    ``beta_fast`` times over ``original_context``, is slowed by ``factor`` (interpolation) when it turns
    fewer than ``beta_slow`` times, and blends linearly between; ``truncate`` rounds the blend's edges
    outward to whole pairs (Hugging Face's default; GPT-OSS releases set it false).

    Two magnitudes come with it, both ``mscale(s, m) = 0.1 * m * ln(s) + 1`` (1 for ``s <= 1``):
    ``rotary_amplitude`` multiplies the cached cos and sin, so q and k (the rotated part of them) grow by
    it; the release gives it as ``attention_factor``, else it is ``mscale(factor, mscale) /
    mscale(factor, mscale_all_dim)`` when both are set (1 for DeepSeek-V3, whose two are equal), else
    ``mscale(factor, 1)`` (GPT-OSS). ``softmax_scale_multiplier`` is DeepSeek's extra factor on the
    softmax scale, ``mscale(factor, mscale_all_dim) ** 2`` (1 when ``mscale_all_dim`` is 0): MLA applies
    it, a family whose reference has no such factor (GPT-OSS) does not ask for it.
    """

    factor: float
    original_context: int  # original_max_position_embeddings
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if not self.factor > 0 or self.original_context < 1 or not self.beta_fast >= self.beta_slow > 0:
            raise ValueError(f"YaRN rope scaling needs factor > 0, original_max_position_embeddings >= 1 and "
                             f"beta_fast >= beta_slow > 0; got {self}")

    @staticmethod
    def _mscale(scale: float, m: float) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    def rotary_amplitude(self) -> float:
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return self._mscale(self.factor, self.mscale) / self._mscale(self.factor, self.mscale_all_dim)
        return self._mscale(self.factor, 1.0)

    def softmax_scale_multiplier(self) -> float:
        return self._mscale(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0

    def _correction_dim(self, rotations: float, head_dim: int, theta: float) -> float:
        """The pair index (fractional) whose wavelength turns ``rotations`` times over the original context."""
        return head_dim * math.log(self.original_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    def frequencies(self, head_dim: int, theta: float) -> torch.Tensor:
        """Per-pair frequencies, float64 (see the class docstring)."""
        base = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        low = self._correction_dim(self.beta_fast, head_dim, theta)
        high = self._correction_dim(self.beta_slow, head_dim, theta)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001  # a one-pair band: keep the ramp finite
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        # ramp 0: fast pairs, extrapolated (kept); ramp 1: slow pairs, interpolated (divided by factor)
        return base / self.factor * ramp + base * (1 - ramp)

    @classmethod
    def from_hf(cls, params: Mapping[str, object], max_position_embeddings: int) -> "YarnScaling":
        """From a release's ``rope_scaling`` / ``rope_parameters`` with ``rope_type`` (or ``type``) ``yarn``.

        A missing ``factor`` is ``max_position_embeddings / original_max_position_embeddings`` (as
        Hugging Face reads it); unknown keys are ignored by the reader of the whole config, not here.
        """
        def num(key: str, default: float) -> float:
            value = _json_number(params, key)
            return default if value is None else value

        original = int(num("original_max_position_embeddings", float(max_position_embeddings)))
        factor = num("factor", max_position_embeddings / original)
        return cls(factor=factor, original_context=original, beta_fast=num("beta_fast", 32.0) or 32.0,
                   beta_slow=num("beta_slow", 1.0) or 1.0, mscale=num("mscale", 0.0),
                   mscale_all_dim=num("mscale_all_dim", 0.0),
                   attention_factor=_json_number(params, "attention_factor"),
                   truncate=bool(params.get("truncate", True)))

    def to_hf(self) -> dict[str, float | int | bool | str]:
        """The ``rope_parameters`` entries (without ``rope_theta``) that ``from_hf`` reads back to this."""
        out: dict[str, float | int | bool | str] = {
            "rope_type": "yarn", "factor": self.factor, "original_max_position_embeddings": self.original_context,
            "beta_fast": self.beta_fast, "beta_slow": self.beta_slow, "truncate": self.truncate}
        if self.mscale:
            out["mscale"] = self.mscale
        if self.mscale_all_dim:
            out["mscale_all_dim"] = self.mscale_all_dim
        if self.attention_factor is not None:
            out["attention_factor"] = self.attention_factor
        return out


RopeScaling = Mapping[str, float] | YarnScaling


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """Per-pair rotation frequencies theta_i = theta^(-2i/head_dim), float64.

    ``scaling``: a ``YarnScaling`` (its own rule), or ``ModelArgs.rope_scaling_params()`` for the
    Llama 3.1 rule: low frequencies (wavelength above original_context / low_freq_factor) are slowed
    down by ``factor``, high frequencies (wavelength below original_context / high_freq_factor) are
    kept, and the band in between is blended linearly.
    """
    if isinstance(scaling, YarnScaling):
        return scaling.frequencies(head_dim, theta)
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
    head_dim: int, max_seq_len: int, theta: float, scaling: RopeScaling | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Real-valued rotary cache of shape [max_seq_len, head_dim], float32.

    Row p is cat(cos(p * theta_i), sin(p * theta_i)) for i in 0..head_dim/2-1, i.e. the
    first half holds cosines and the second half sines. Angles are computed in float64
    because p * theta_i loses several bits in float32 at long context. Under YaRN both halves are
    multiplied by its ``rotary_amplitude`` (the rotated q and k grow by it).
    """
    freqs = rope_frequencies(head_dim, theta, scaling).to(device)
    pos = torch.arange(max_seq_len, dtype=torch.float64, device=device)
    angles = torch.outer(pos, freqs)
    cache = torch.cat([angles.cos(), angles.sin()], dim=-1)
    if isinstance(scaling, YarnScaling):
        cache = cache * scaling.rotary_amplitude()
    return cache.float()


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
