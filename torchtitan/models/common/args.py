"""The arguments shared by the families whose head size and SwiGLU width are fields and whose layers may
hold experts: Qwen3 (dense and MoE), Mixtral, DeepSeek-V3 and GPT-OSS.

``MoEDecoderArgs`` subclasses the abstract root ``DecoderConfig`` (``config.py``) with grouped-query
widths, the dense SwiGLU width and Hugging Face's expert fields (``num_experts`` 0: dense). It is abstract
too: each family subclasses it (its own type: the registry finds the family by it) with its attention
and its own fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torchtitan.models.common.config import DecoderConfig
from torchtitan.models.moe import MoEArgs
from torchtitan.models.moe.router import check_routing


@dataclass
class MoEDecoderArgs(DecoderConfig):
    """Hyper-parameters of a (possibly sparse) decoder; Hugging Face's names are in the comments."""

    dim: int = 1024  # hidden_size
    n_layers: int = 28  # num_hidden_layers
    n_heads: int = 16  # num_attention_heads
    vocab_size: int = 151936
    norm_eps: float = 1e-6  # rms_norm_eps
    rope_theta: float = 1000000.0
    max_seq_len: int = 4096
    n_kv_heads: int = 8  # num_key_value_heads
    head_dim: int = 128  # head_dim (Qwen3: not dim / n_heads in general)
    ffn_hidden_size: int = 3072  # intermediate_size: the dense layers' SwiGLU width
    # ---- experts (num_experts 0: dense)
    num_experts: int = 0  # num_experts (hub) / num_local_experts (transformers 5, Mixtral)
    top_k: int = 2  # num_experts_per_tok
    moe_hidden_size: int = 0  # moe_intermediate_size (Mixtral: intermediate_size)
    norm_topk_prob: bool = True  # renormalise the chosen experts' softmax weights to sum to one
    mlp_only_layers: tuple[int, ...] = ()  # layers kept dense
    decoder_sparse_step: int = 1  # every step-th layer is sparse (layer i: (i + 1) % step == 0)
    use_grouped_mm: bool = True
    # ---- balancing: the job's [moe] section sets these (preflight: Decoder.with_job_options), not the flavor
    load_balance_coeff: float = 0.0  # > 0: the auxiliary-loss-free routing bias, moved by this much per step
    aux_loss: Literal["none", "switch", "sequence"] = "none"
    aux_loss_coeff: float = 0.0
    overlap_all_to_all: bool = True  # the shared experts run while the routed tokens travel (the same model)
    dispatch_gpus_per_node: int = 0  # > 0: the two-hop dispatch across nodes of this many ranks (node_dispatch.py)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.mlp_only_layers = tuple(self.mlp_only_layers)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.num_experts:
            routing = self.moe_args()
            check_routing(self.num_experts, self.top_k, routing.score_func, routing.num_groups, routing.topk_groups)
            if self.moe_hidden_size < 1 or self.decoder_sparse_step < 1:
                raise ValueError(f"moe_hidden_size={self.moe_hidden_size} and decoder_sparse_step="
                                 f"{self.decoder_sparse_step} must be positive in a model with experts")

    def dense_ffn_dim(self) -> int:
        return self.ffn_hidden_size

    def is_moe_layer(self, i: int) -> bool:
        """Hugging Face's rule: sparse iff not in mlp_only_layers, experts exist, and (i + 1) % step == 0."""
        return i not in self.mlp_only_layers and self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0

    def moe_args(self) -> MoEArgs:
        """The experts' arguments with Qwen3-MoE's and Mixtral's routing (softmax, no groups, no shared
        expert); a family routing otherwise replaces those (DeepSeek-V3)."""
        return MoEArgs(dim=self.dim, hidden_dim=self.moe_hidden_size, num_experts=self.num_experts,
                       top_k=self.top_k, norm_topk_prob=self.norm_topk_prob,
                       load_balance_bias=self.load_balance_coeff > 0, aux_loss=self.aux_loss,
                       aux_loss_coeff=self.aux_loss_coeff, use_grouped_mm=self.use_grouped_mm,
                       overlap_all_to_all=self.overlap_all_to_all,
                       dispatch_gpus_per_node=self.dispatch_gpus_per_node)
