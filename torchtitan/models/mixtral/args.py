"""Mixtral's arguments and named sizes.

``8x7B`` is the ``config.json`` of ``mistralai/Mixtral-8x7B-v0.1``: hidden_size 4096, 32 layers, 32 heads,
8 key/value heads, intermediate_size 14336 (each expert), 8 local experts, 2 per token, vocab 32000,
rope_theta 1e6, rms_norm_eps 1e-5, untied.
"""

from dataclasses import dataclass

from torchtitan.models.attention import GQAConfig
from torchtitan.models.common.args import MoEDecoderArgs


@dataclass
class MixtralArgs(MoEDecoderArgs):
    """Mixtral: ``MoEDecoderArgs`` with plain grouped-query attention, every layer sparse, softmax weights
    renormalised."""

    def attention(self) -> GQAConfig:
        """Grouped-query attention without a query/key norm."""
        return GQAConfig(self.dim, self.n_heads, self.n_kv_heads, self.head_dim)


mixtral_flavors: dict[str, MixtralArgs] = {
    # Tiny model for tests and smoke runs.
    "debugmodel": MixtralArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32, vocab_size=2048,
                              ffn_hidden_size=256, moe_hidden_size=256, num_experts=8, top_k=2, norm_eps=1e-5,
                              max_seq_len=2048),
    "8x7B": MixtralArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, vocab_size=32000,
                        ffn_hidden_size=14336, moe_hidden_size=14336, num_experts=8, top_k=2, norm_eps=1e-5,
                        rope_theta=1000000.0, max_seq_len=32768),
}
