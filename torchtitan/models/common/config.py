"""What the shared decoder reads from a family's arguments: the abstract root ``DecoderConfig``.

Every family's arguments are a dataclass subclassing it (Llama 3's ``ModelArgs``; ``common/args.py``'s
``MoEDecoderArgs`` for Qwen3, Mixtral, DeepSeek-V3 and GPT-OSS); the decoder, its init specs, TP plan,
FLOPs count and preflight checks read nothing else. A family differs from another only in its own
fields and in how it answers these queries.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from torchtitan.models.attention.backends import AttentionNeeds
from torchtitan.models.attention.masks import check_mask_type
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

    def qk_clip_refusal(self) -> str | None:
        """Why QK-clip (``--optimizer.name MuonClip``) cannot bound this attention's logits; None: it can."""
        ...


@dataclass
class DecoderConfig(ABC):
    """The abstract root of every family's arguments: the fields the shared decoder reads of any family.

    Abstract: neither built nor registered as a family's arguments (``ModelSpec`` refuses it). A family's
    dataclass subclasses it, states its own defaults for the shape fields, adds its own fields and answers
    the abstract queries (``head_dim``, ``attention``, ``dense_ffn_dim``); the other queries default to a
    dense decoder with one attention on every layer and no multi-token prediction. No family's field
    belongs here (tests/models/test_args_root.py keeps the field list to what the decoder reads).
    """

    # The shape, with each family's defaults there. Preflight replaces vocab_size (a named flavor takes the
    # tokenizer's), max_seq_len (the training sequence length), n_layers (pipeline stand-ins) and attn_mask_type.
    dim: int
    n_layers: int
    n_heads: int
    vocab_size: int
    norm_eps: float
    rope_theta: float
    max_seq_len: int
    tie_word_embeddings: bool = False  # one parameter serves as the embedding and the output projection
    # True: output projections of layer i get std 0.02 / sqrt(2 * (i + 1)); False: 0.02 / sqrt(2 * n_layers).
    depth_init: bool = True
    # "block_causal": a token attends only to earlier tokens of its own document (documents are read from the
    # positions passed to forward, which restart at 0 per document); "causal": every earlier token of the
    # window. See docs/attention_masks.md.
    attn_mask_type: str = "block_causal"

    def __post_init__(self) -> None:
        check_mask_type(self.attn_mask_type)

    @property
    @abstractmethod
    def head_dim(self) -> int:
        """The query/key head size the rotary cache is built for."""

    @abstractmethod
    def attention(self) -> AttentionConfig:
        """The attention module each block is given."""

    @abstractmethod
    def dense_ffn_dim(self) -> int:
        """The SwiGLU width of the dense layers."""

    @property
    def num_experts(self) -> int:
        """Experts per sparse layer; 0: a dense model."""
        return 0

    def is_moe_layer(self, i: int) -> bool:
        return False

    def moe_args(self) -> MoEArgs:
        raise ValueError(f"{type(self).__name__} describes a model without experts")

    def rope_scaling_params(self) -> RopeScaling | None:
        """The rotary frequencies' scaling (``layers.rope_frequencies``); None: none."""
        return None

    def layer_attention(self, layer: int) -> AttentionConfig:
        """Layer ``layer``'s attention (GPT-OSS: its window; the others: ``attention()`` on every layer)."""
        return self.attention()

    def with_first_layers(self, n_layers: int) -> DecoderConfig:
        """The same model cut to its first ``n_layers`` blocks, per-layer patterns cut alike (the planner's
        shorter stand-ins)."""
        return dataclasses.replace(self, n_layers=n_layers)

    @property
    def has_mtp(self) -> bool:
        """Whether the family can predict further tokens (``--model.mtp_layers``; DeepSeek-V3)."""
        return False

    @property
    def mtp_depths(self) -> int:
        """The multi-token prediction depths the model adds; 0: none."""
        return 0
