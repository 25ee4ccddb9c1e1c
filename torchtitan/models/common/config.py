"""What the shared decoder reads from a family's arguments: ``DecoderConfig``.

Every family's arguments are a dataclass that satisfies this protocol (Llama 3's ``ModelArgs``, the
``DecoderArgs`` of Qwen3 and Mixtral); the decoder, its init specs, TP plan, FLOPs count and preflight
checks read nothing else. A family differs from another only in how its fields give these answers.
"""

from __future__ import annotations

from dataclasses import Field
from typing import Any, ClassVar, Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from torchtitan.models.attention.backends import AttentionNeeds
from torchtitan.models.kv_cache import LayerCacheSize
from torchtitan.models.layers import RopeScaling
from torchtitan.models.moe import MoEArgs

JsonObject = dict[str, Any]  # a config.json / params.json as json.loads gives it


class AttentionModule(Protocol):
    """What the decoder asks of a block's attention module besides its forward (``forward(x, rope_cache, *,
    backend, documents=None, cache=None)``): grouped-query (``attention/gqa.py``) or MLA (``deepseek_v3/mla.py``)."""

    def in_projections(self) -> list[nn.Linear]:
        """The projections into the heads (init: trunc_normal(0.02))."""
        ...

    def out_projections(self) -> list[nn.Linear]:
        """The projections out of the heads (init: depth-scaled)."""
        ...

    def tp_plan(self, seq: Shard | Replicate, tp_mesh: DeviceMesh) -> dict[str, ParallelStyle]:
        """Its TP plan, names relative to it ("" is the module itself); ``seq``: the residual stream's layout."""
        ...

    def __call__(self, x: torch.Tensor, rope_cache: torch.Tensor, **kwargs: object) -> torch.Tensor: ...


class AttentionConfig(Protocol):
    """An attention's shape: the module it builds, what it needs of a backend, its size, TP widths and what a
    decoding cache keeps of it per token."""

    def build(self) -> AttentionModule: ...

    def needs(self, mask_type: str) -> AttentionNeeds: ...

    def num_params(self) -> int: ...

    def tp_widths(self) -> list[tuple[str, int]]: ...

    def cache_size(self) -> LayerCacheSize: ...


class DecoderConfig(Protocol):
    """A decoder's shape; the four plain fields are those preflight replaces from the job's config.

    A dataclass (``dataclasses.replace`` makes variants of it).
    """

    __dataclass_fields__: ClassVar[dict[str, Field[object]]]

    vocab_size: int  # a named flavor takes the tokenizer's
    max_seq_len: int  # the training sequence length
    attn_mask_type: str  # --model.attn_mask_type
    n_layers: int  # the blocks that pipeline stages split
    dim: int
    n_heads: int
    norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    # True: output projections of layer i get std 0.02 / sqrt(2 * (i + 1)); False: 0.02 / sqrt(2 * n_layers).
    depth_init: bool

    @property
    def head_dim(self) -> int: ...

    @property
    def num_experts(self) -> int:
        """Experts per sparse layer; 0: a dense model."""
        ...

    def attention(self) -> AttentionConfig:
        """The attention module each block is given."""
        ...

    def rope_scaling_params(self) -> RopeScaling | None:
        """The rotary frequencies' scaling (``layers.rope_frequencies``); None: none."""
        ...

    def dense_ffn_dim(self) -> int:
        """The SwiGLU width of the dense layers."""
        ...

    def is_moe_layer(self, i: int) -> bool: ...

    def moe_args(self) -> MoEArgs: ...

    def layer_attention(self, layer: int) -> AttentionConfig:
        """Layer ``layer``'s attention (GPT-OSS: its window; the others: ``attention()`` on every layer)."""
        ...

    def with_first_layers(self, n_layers: int) -> DecoderConfig:
        """The same model cut to its first ``n_layers`` blocks, per-layer patterns cut alike (the planner's
        shorter stand-ins)."""
        ...

    @property
    def has_mtp(self) -> bool:
        """Whether the family can predict further tokens (``--model.mtp_layers``; DeepSeek-V3)."""
        ...

    @property
    def mtp_depths(self) -> int:
        """The multi-token prediction depths the model adds; 0: none."""
        ...
