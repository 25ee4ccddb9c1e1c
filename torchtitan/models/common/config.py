"""What the shared decoder reads from a family's arguments: ``DecoderConfig``.

Every family's arguments are a dataclass that satisfies this protocol (Llama 3's ``ModelArgs``, the
``DecoderArgs`` of Qwen3 and Mixtral); the decoder, its init specs, TP plan, FLOPs count and preflight
checks read nothing else. A family differs from another only in how its fields give these answers.
"""

from __future__ import annotations

from dataclasses import Field
from typing import Any, ClassVar, Protocol

from torchtitan.models.attention.gqa import GQAConfig
from torchtitan.models.moe import MoEArgs

JsonObject = dict[str, Any]  # a config.json / params.json as json.loads gives it


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

    def attention(self) -> GQAConfig:
        """The attention module each block is given."""
        ...

    def rope_scaling_params(self) -> dict[str, float] | None:
        """The rotary frequencies' scaling (``layers.rope_frequencies``); None: none."""
        ...

    def dense_ffn_dim(self) -> int:
        """The SwiGLU width of the dense layers."""
        ...

    def is_moe_layer(self, i: int) -> bool: ...

    def moe_args(self) -> MoEArgs: ...
