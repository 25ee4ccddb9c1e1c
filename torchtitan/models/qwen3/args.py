"""Qwen3's arguments and named sizes: dense Qwen3 and Qwen3-MoE.

The released shapes are the ``config.json`` of each Hugging Face release (``Qwen/Qwen3-<size>``):
hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim (128 in all),
intermediate_size, and for the MoE ones moe_intermediate_size, num_experts (128),
num_experts_per_tok (8), norm_topk_prob (true), decoder_sparse_step (1), mlp_only_layers ([]).
All have vocab_size 151936, rope_theta 1e6, rms_norm_eps 1e-6; 0.6B, 1.7B and 4B tie the embedding.
"""

from dataclasses import dataclass

from torchtitan.models.attention import GQAConfig
from torchtitan.models.common.args import MoEDecoderArgs


@dataclass
class Qwen3Args(MoEDecoderArgs):
    """Qwen3 and Qwen3-MoE: ``MoEDecoderArgs`` (its own type: the registry finds the family by it)."""

    def attention(self) -> GQAConfig:
        """Grouped-query attention with Qwen3's per-head query/key RMSNorm before RoPE."""
        return GQAConfig(self.dim, self.n_heads, self.n_kv_heads, self.head_dim, self.norm_eps)


def _dense(dim: int, n_layers: int, n_heads: int, ffn: int, tied: bool) -> Qwen3Args:
    return Qwen3Args(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=8, head_dim=128, ffn_hidden_size=ffn,
                     tie_word_embeddings=tied, max_seq_len=40960)


qwen3_flavors: dict[str, Qwen3Args] = {
    # Tiny dense model for tests and smoke runs: GQA, head_dim != dim / n_heads, tied.
    "debugmodel": Qwen3Args(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=64, vocab_size=2048,
                            ffn_hidden_size=512, tie_word_embeddings=True, max_seq_len=2048),
    # Tiny MoE: 8 experts, top-2, layer 0 dense (mlp_only_layers), the rest sparse.
    "debugmodel_moe": Qwen3Args(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32, vocab_size=2048,
                                ffn_hidden_size=512, max_seq_len=2048, num_experts=8, top_k=2, moe_hidden_size=128,
                                mlp_only_layers=(0,)),
    "0.6B": _dense(1024, 28, 16, 3072, True),  # Qwen/Qwen3-0.6B
    "1.7B": _dense(2048, 28, 16, 6144, True),  # Qwen/Qwen3-1.7B
    "4B": _dense(2560, 36, 32, 9728, True),  # Qwen/Qwen3-4B
    "8B": _dense(4096, 36, 32, 12288, False),  # Qwen/Qwen3-8B
    "14B": _dense(5120, 40, 40, 17408, False),  # Qwen/Qwen3-14B
    "32B": _dense(5120, 64, 64, 25600, False),  # Qwen/Qwen3-32B
    # Qwen/Qwen3-30B-A3B: 128 experts of width 768, 8 per token, every layer sparse.
    "30B-A3B": Qwen3Args(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128, ffn_hidden_size=6144,
                         num_experts=128, top_k=8, moe_hidden_size=768, max_seq_len=40960),
    # Qwen/Qwen3-235B-A22B: 128 experts of width 1536, 8 per token, every layer sparse.
    "235B-A22B": Qwen3Args(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, head_dim=128, ffn_hidden_size=12288,
                           num_experts=128, top_k=8, moe_hidden_size=1536, max_seq_len=40960),
}
