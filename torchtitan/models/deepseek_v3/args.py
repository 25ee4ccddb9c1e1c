"""DeepSeek-V3's arguments and named sizes.

The shapes are the ``config.json`` of each release: ``deepseek-ai/DeepSeek-V3`` (671B),
``moonshotai/Kimi-K2-Instruct`` (kimi_k2) and ``moonshotai/Moonlight-16B-A3B`` (16B, DeepSeek-V2-Lite's
attention and expert widths with DeepSeek-V3's routing). Hugging Face's names are in the comments.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from torchtitan.models.common.args import MoEDecoderArgs
from torchtitan.models.deepseek_v3.mla import MLAConfig
from torchtitan.models.layers import YarnScaling
from torchtitan.models.moe import MoEArgs


@dataclass
class DeepSeekV3Args(MoEDecoderArgs):
    """``MoEDecoderArgs`` plus multi-head latent attention, DeepSeek-V3's routing and multi-token prediction.

    Derived, not set: ``n_kv_heads`` (= ``n_heads``: MLA expands keys and values for every head),
    ``head_dim`` (= ``qk_nope_head_dim + qk_rope_head_dim``, the query/key head), ``mlp_only_layers``
    (the first ``first_k_dense_replace``).
    """

    q_lora_rank: int = 0  # q_lora_rank (None there): 0 is one projection wq, else wq_a -> q_norm -> wq_b
    kv_lora_rank: int = 512  # the latent that keys and values are expanded from
    qk_nope_head_dim: int = 128  # the part of each query/key head without rotary positions
    qk_rope_head_dim: int = 64  # the rotary part; one rotary key shared by every head
    v_head_dim: int = 128
    first_k_dense_replace: int = 1  # the first layers keep a dense feed-forward
    yarn: YarnScaling | None = None  # rope_scaling / rope_parameters with rope_type yarn
    num_mtp_layers: int = 0  # multi-token prediction depths (num_nextn_predict_layers); 0: off
    mtp_loss_weight: float = 0.3  # lambda of the report's L = L_main + lambda / D * sum_k L_MTP^k
    # ---- routing beyond Qwen3-MoE's; the releases score by sigmoid (the table's fixed score_func)
    score_func: Literal["softmax", "sigmoid"] = "softmax"  # scoring_func
    route_scale: float = 1.0  # routed_scaling_factor
    num_shared_experts: int = 0  # n_shared_experts
    num_groups: int = 1  # n_group: group-limited routing
    topk_groups: int = 1  # topk_group

    def __post_init__(self) -> None:
        self.check_mla()
        self.n_kv_heads = self.n_heads
        self.head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.mlp_only_layers = tuple(range(min(self.first_k_dense_replace, self.n_layers)))
        super().__post_init__()
        if self.num_mtp_layers < 0 or self.mtp_loss_weight < 0:
            raise ValueError(f"num_mtp_layers={self.num_mtp_layers} and mtp_loss_weight={self.mtp_loss_weight} "
                             "must not be negative")

    def check_mla(self) -> None:
        """ValueError, one line naming the option, for an MLA shape that cannot work."""
        rope = self.qk_rope_head_dim
        if rope < 2 or rope % 2:
            raise ValueError(f"qk_rope_head_dim={rope} must be even and positive: rotary embeddings turn pairs")
        if self.qk_nope_head_dim < 0:
            raise ValueError(f"qk_rope_head_dim={rope} is larger than the query/key head "
                             f"(qk_nope_head_dim {self.qk_nope_head_dim} + qk_rope_head_dim); make the rotary "
                             "part a slice of the head")
        if self.kv_lora_rank < 1 or self.v_head_dim < 1 or self.q_lora_rank < 0 or self.first_k_dense_replace < 0:
            raise ValueError(f"kv_lora_rank={self.kv_lora_rank} and v_head_dim={self.v_head_dim} must be positive, "
                             f"q_lora_rank={self.q_lora_rank} and first_k_dense_replace="
                             f"{self.first_k_dense_replace} not negative")

    def attention(self) -> MLAConfig:  # the block's attention module: MLA
        return MLAConfig(dim=self.dim, n_heads=self.n_heads, q_lora_rank=self.q_lora_rank,
                         kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
                         qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim, norm_eps=self.norm_eps,
                         softmax_scale=self.softmax_scale())

    def moe_args(self) -> MoEArgs:
        """The shared MoE's with DeepSeek-V3's routing, and the routing bias always there: its
        ``e_score_correction_bias`` is part of the model (the job's ``load_balance_coeff`` says whether training
        moves it)."""
        return dataclasses.replace(super().moe_args(), score_func=self.score_func, route_scale=self.route_scale,
                                   num_shared_experts=self.num_shared_experts, num_groups=self.num_groups,
                                   topk_groups=self.topk_groups, load_balance_bias=True)

    def rope_scaling_params(self) -> YarnScaling | None:
        return self.yarn

    @property
    def has_mtp(self) -> bool:
        return True

    @property
    def mtp_depths(self) -> int:
        return self.num_mtp_layers

    def softmax_scale(self) -> float:
        """``qk_head_dim ** -0.5``, times YaRN's ``mscale(factor, mscale_all_dim) ** 2`` (DeepSeek's rule)."""
        scale = self.head_dim**-0.5
        return scale * self.yarn.softmax_scale_multiplier() if self.yarn is not None else scale


def _release(**kw) -> DeepSeekV3Args:  # noqa: ANN003 - the fields
    return DeepSeekV3Args(score_func="sigmoid", norm_topk_prob=True, **kw)


_V3_YARN = YarnScaling(factor=40.0, original_context=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                       mscale_all_dim=1.0)

deepseek_v3_flavors: dict[str, DeepSeekV3Args] = {
    # CPU seconds: MLA with a query LoRA, YaRN, 8 experts in 2 groups, one shared, layer 0 dense.
    "debugmodel": _release(
        dim=256, n_layers=4, n_heads=8, vocab_size=2048, ffn_hidden_size=512, max_seq_len=2048,
        q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24,
        num_experts=8, top_k=2, moe_hidden_size=128, num_shared_experts=1, num_groups=2, topk_groups=1,
        route_scale=2.5, first_k_dense_replace=1,
        yarn=YarnScaling(factor=4.0, original_context=512, mscale=0.707, mscale_all_dim=0.707)),
    # moonshotai/Moonlight-16B-A3B (DeepSeek-V2-Lite's shape, DeepSeek-V3's routing): no query LoRA.
    "16B": _release(
        dim=2048, n_layers=27, n_heads=16, vocab_size=163840, ffn_hidden_size=11264, max_seq_len=8192,
        q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        num_experts=64, top_k=6, moe_hidden_size=1408, num_shared_experts=2, route_scale=2.446,
        first_k_dense_replace=1, rope_theta=50000.0, norm_eps=1e-5),
    # deepseek-ai/DeepSeek-V3: 61 layers, 3 dense, 256 experts in 8 groups (4 kept), top-8, one shared (its one
    # MTP module: --model.mtp_layers=1).
    "671B": _release(
        dim=7168, n_layers=61, n_heads=128, vocab_size=129280, ffn_hidden_size=18432, max_seq_len=163840,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        num_experts=256, top_k=8, moe_hidden_size=2048, num_shared_experts=1, num_groups=8, topk_groups=4,
        route_scale=2.5, first_k_dense_replace=3, yarn=_V3_YARN),
    # moonshotai/Kimi-K2-Instruct: DeepSeek-V3's shape with 64 heads, 384 experts in one group, one dense layer.
    "kimi_k2": _release(
        dim=7168, n_layers=61, n_heads=64, vocab_size=163840, ffn_hidden_size=18432, max_seq_len=131072,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        num_experts=384, top_k=8, moe_hidden_size=2048, num_shared_experts=1, route_scale=2.827,
        first_k_dense_replace=1, rope_theta=50000.0,
        yarn=YarnScaling(factor=32.0, original_context=4096, beta_fast=1.0, beta_slow=1.0, mscale=1.0,
                         mscale_all_dim=1.0)),
}
