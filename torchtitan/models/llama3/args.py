"""Hyper-parameters of the Llama 3 family and the named model sizes ("flavors").

``ModelArgs`` subclasses the abstract root ``DecoderConfig`` (models/common/config.py): Llama 3 is the
shared decoder with grouped-query attention without a query/key norm, ``head_dim = dim / n_heads``, a
SwiGLU width derived as Meta's ``params.json`` describes it, the Llama 3.1 rotary scaling, and no experts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torchtitan.models.attention import GQAConfig
from torchtitan.models.common.config import DecoderConfig


@dataclass
class ModelArgs(DecoderConfig):
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    vocab_size: int = 128256
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 2048
    # None means plain multi-head attention (one K/V head per query head).
    n_kv_heads: int | None = None
    # The SwiGLU hidden size is rounded up to a multiple of this (kernel-friendly shapes).
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    # The SwiGLU hidden size as a release states it (HF intermediate_size); None: derived from
    # dim, ffn_dim_multiplier and multiple_of as Meta's params.json describe it.
    ffn_hidden_size: int | None = None
    # Llama 3.1 long-context frequency scaling: frequencies whose wavelength exceeds
    # original_context / low_freq_factor are divided by the factor, those below
    # original_context / high_freq_factor are kept, the band between is blended.
    # Published values: factor 8 for 3.1 (8B, 70B, 405B), 32 for 3.2 (1B, 3B).
    rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.dim % self.n_heads != 0:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if (self.dim // self.n_heads) % 2 != 0:
            raise ValueError("head_dim must be even for rotary embeddings")
        if self.rope_scaling and not self.rope_high_freq_factor > self.rope_low_freq_factor:
            raise ValueError(f"rope_high_freq_factor={self.rope_high_freq_factor} must exceed "
                             f"rope_low_freq_factor={self.rope_low_freq_factor}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_dim(self) -> int:
        """The SwiGLU width (``ffn_hidden_dim``), as config.json's ``intermediate_size`` states it."""
        return ffn_hidden_dim(self)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    def attention(self) -> GQAConfig:
        """Grouped-query attention, head_dim = dim / n_heads, no query/key norm."""
        return GQAConfig(self.dim, self.n_heads, self.kv_heads, self.head_dim)

    def dense_ffn_dim(self) -> int:
        return ffn_hidden_dim(self)

    def layer_attention(self, layer: int) -> GQAConfig:
        return self.attention()

    def with_first_layers(self, n_layers: int) -> ModelArgs:
        return dataclasses.replace(self, n_layers=n_layers)

    def rope_scaling_params(self) -> dict[str, float] | None:
        """The scaling rule's parameters (keyword arguments of ``rope_frequencies``), None when off."""
        if not self.rope_scaling:
            return None
        return {"factor": self.rope_scaling_factor, "low_freq_factor": self.rope_low_freq_factor,
                "high_freq_factor": self.rope_high_freq_factor, "original_context": self.rope_original_max_seq_len}


def ffn_hidden_dim(args: ModelArgs) -> int:
    """SwiGLU width: as the release states it (``ffn_hidden_size``), else 2/3 of 4*dim (keeps
    params equal to a 4x GELU MLP), optionally scaled, then rounded up to a multiple of `multiple_of`."""
    if args.ffn_hidden_size is not None:
        return args.ffn_hidden_size
    hidden = int(2 * (4 * args.dim) / 3)
    if args.ffn_dim_multiplier is not None:
        hidden = int(args.ffn_dim_multiplier * hidden)
    return args.multiple_of * ((hidden + args.multiple_of - 1) // args.multiple_of)


llama3_flavors: dict[str, ModelArgs] = {
    # Tiny model for tests and smoke runs; n_kv_heads < n_heads so GQA is exercised.
    # "debugmodel_tied" (below) is the same with tied embeddings.
    "debugmodel": ModelArgs(
        dim=256,
        n_layers=6,
        n_heads=16,
        n_kv_heads=8,
        vocab_size=2048,
        multiple_of=256,
        rope_theta=500000.0,
        max_seq_len=2048,
    ),
    # Llama 3.2 1B: the output projection is the embedding (1,235,814,400 parameters).
    "1B": ModelArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=256,
        ffn_dim_multiplier=1.5,
        rope_theta=500000.0,
        rope_scaling=True,
        rope_scaling_factor=32.0,  # 3.2 1B/3B use 32 (3.1 uses 8)
        max_seq_len=131072,
        tie_word_embeddings=True,
    ),
    # Llama 3.2 3B (3,212,749,824 parameters, tied like 1B).
    "3B": ModelArgs(
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_hidden_size=8192,
        rope_theta=500000.0,
        rope_scaling=True,
        rope_scaling_factor=32.0,
        max_seq_len=131072,
        tie_word_embeddings=True,
    ),
    "8B": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=1024,
        ffn_dim_multiplier=1.3,
        rope_theta=500000.0,
        rope_scaling=True,
        max_seq_len=131072,
    ),
    "70B": ModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=4096,
        ffn_dim_multiplier=1.3,
        rope_theta=500000.0,
        rope_scaling=True,
        max_seq_len=131072,
    ),
    "405B": ModelArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=4096,
        ffn_dim_multiplier=1.2,
        rope_theta=500000.0,
        rope_scaling=True,
        max_seq_len=131072,
    ),
}

llama3_flavors["debugmodel_tied"] = dataclasses.replace(llama3_flavors["debugmodel"], tie_word_embeddings=True)
