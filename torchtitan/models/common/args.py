"""The arguments of the decoder families that read Hugging Face configs alike: Qwen3, Qwen3-MoE, Mixtral.

``DecoderArgs`` is a ``DecoderConfig`` (``config.py``) with every width a field: the head size
independent of ``dim``, the query/key norm as an option, and the experts' fields (``num_experts`` 0:
dense). A family subclasses it (its own type: the registry finds the family by it) with its defaults.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from torchtitan.models.attention import GQAConfig, check_mask_type
from torchtitan.models.common.config import AttentionConfig
from torchtitan.models.layers import RopeScaling
from torchtitan.models.moe import MoEArgs
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
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    route_scale: float = 1.0
    num_shared_experts: int = 0
    num_groups: int = 1  # group-limited routing
    topk_groups: int = 1
    # ---- balancing: the job's [moe] section sets these (preflight), not the flavor
    load_balance_coeff: float = 0.0  # > 0: the auxiliary-loss-free routing bias, moved by this much per step
    aux_loss: Literal["none", "switch", "sequence"] = "none"
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

    def attention(self) -> GQAConfig:
        return GQAConfig(self.dim, self.n_heads, self.n_kv_heads, self.head_dim,
                         self.norm_eps if self.qk_norm else None)

    def dense_ffn_dim(self) -> int:
        return self.ffn_hidden_size

    def rope_scaling_params(self) -> RopeScaling | None:
        """No frequency scaling in these families (the decoder's rotary cache asks)."""
        return None

    def layer_attention(self, layer: int) -> AttentionConfig:
        return self.attention()

    def with_first_layers(self, n_layers: int) -> DecoderArgs:
        return dataclasses.replace(self, n_layers=n_layers)

    @property
    def has_mtp(self) -> bool:
        return False

    @property
    def mtp_depths(self) -> int:
        return 0

    def is_moe_layer(self, i: int) -> bool:
        """Hugging Face's rule: sparse iff not in mlp_only_layers, experts exist, and (i + 1) % step == 0."""
        return i not in self.mlp_only_layers and self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0

    def moe_args(self) -> MoEArgs:
        return MoEArgs(dim=self.dim, hidden_dim=self.moe_hidden_size, num_experts=self.num_experts,
                       top_k=self.top_k, num_shared_experts=self.num_shared_experts, score_func=self.score_func,
                       norm_topk_prob=self.norm_topk_prob, route_scale=self.route_scale, num_groups=self.num_groups,
                       topk_groups=self.topk_groups, load_balance_bias=self.load_balance_coeff > 0,
                       aux_loss=self.aux_loss, aux_loss_coeff=self.aux_loss_coeff, use_grouped_mm=self.use_grouped_mm)
