"""GPT-OSS's arguments and named sizes.

``20b`` and ``120b`` are the ``config.json`` of ``openai/gpt-oss-20b`` and ``openai/gpt-oss-120b``:
hidden_size 2880, head_dim 64, 64 query heads, 8 key/value heads, every layer a MoE of experts of
width 2880 (intermediate_size), 4 per token, 24 layers and 32 experts (20b) or 36 and 128 (120b);
vocab 201088, rms_norm_eps 1e-5, rope_theta 150000 with YaRN (factor 32 over 4096 positions,
beta_fast 32, beta_slow 1, not truncated), sliding_window 128 on the even layers, swiglu_limit 7,
untied. The releases hold the experts in MXFP4 (dequantized on load: ``hf.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torchtitan.models.common.args import MoEDecoderArgs
from torchtitan.models.gpt_oss.attention import SinkAttentionConfig
from torchtitan.models.layers import YarnScaling
from torchtitan.models.moe import MoEArgs

LAYER_TYPES = ("sliding_attention", "full_attention")


def alternating_layer_types(n_layers: int) -> tuple[str, ...]:
    """The releases' pattern (Hugging Face's default): sliding on even layers, full on odd ones."""
    return tuple(LAYER_TYPES[i % 2] for i in range(n_layers))


@dataclass
class GptOssArgs(MoEDecoderArgs):
    """``MoEDecoderArgs`` with GPT-OSS's attention and experts. Every layer is sparse; Hugging Face's names
    are in the comments.

    - attention: biased q/k/v/o projections, a learned sink logit per head, ``sliding_window`` keys
      on the layers whose ``layer_types`` entry is ``sliding_attention``;
    - experts: biased, the clamped SwiGLU ``(clamp(up, +-limit) + 1) * g * sigmoid(alpha * g)`` with
      ``g = clamp(gate, max=limit)``; the router has a bias and weighs the chosen experts by a softmax
      over their logits (``norm_topk_prob``);
    - rotary: YaRN (``rope_yarn``; None: plain).
    """

    norm_eps: float = 1e-5
    sliding_window: int = 128  # sliding_window
    layer_types: tuple[str, ...] = ()  # layer_types; () is the releases' alternation
    swiglu_limit: float = 7.0  # swiglu_limit
    swiglu_alpha: float = 1.702  # swiglu_alpha
    rope_yarn: YarnScaling | None = None  # rope_parameters / rope_scaling with rope_type yarn

    def __post_init__(self) -> None:
        super().__post_init__()
        self.layer_types = tuple(self.layer_types) or alternating_layer_types(self.n_layers)
        if len(self.layer_types) != self.n_layers or any(t not in LAYER_TYPES for t in self.layer_types):
            raise ValueError(f"layer_types must name {self.n_layers} layers, each one of {', '.join(LAYER_TYPES)}; "
                             f"got {list(self.layer_types)}")
        if not self.num_experts or self.mlp_only_layers or self.decoder_sparse_step != 1:
            raise ValueError("GPT-OSS has experts in every layer")
        if self.sliding_window < 1 or self.swiglu_limit <= 0:
            raise ValueError(f"sliding_window={self.sliding_window} and swiglu_limit={self.swiglu_limit} must be "
                             "positive")

    def rope_scaling_params(self) -> YarnScaling | None:
        return self.rope_yarn

    def attention(self) -> SinkAttentionConfig:
        """The model's attention as preflight and the counts see it (the window of a layer: ``layer_attention``)."""
        return SinkAttentionConfig(self.dim, self.n_heads, self.n_kv_heads, self.head_dim)

    def layer_attention(self, layer: int) -> SinkAttentionConfig:
        """Layer ``layer``'s attention: with its window when ``layer_types`` names it sliding."""
        return dataclasses.replace(self.attention(), window=self.window(layer))

    def with_first_layers(self, n_layers: int) -> GptOssArgs:
        """The first ``n_layers`` blocks with their own windows (``layer_types`` cut alike)."""
        return dataclasses.replace(self, n_layers=n_layers, layer_types=self.layer_types[:n_layers])

    def window(self, layer: int) -> int | None:
        """The keys a query of ``layer`` sees at most (None: the whole causal context)."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def moe_args(self) -> MoEArgs:
        return dataclasses.replace(super().moe_args(), router_bias=True)


def _release(n_layers: int, num_experts: int) -> GptOssArgs:
    return GptOssArgs(dim=2880, n_layers=n_layers, n_heads=64, n_kv_heads=8, head_dim=64, vocab_size=201088,
                      ffn_hidden_size=2880, moe_hidden_size=2880, num_experts=num_experts, top_k=4,
                      rope_theta=150000.0, max_seq_len=131072,
                      rope_yarn=YarnScaling(factor=32.0, original_context=4096, beta_fast=32.0, beta_slow=1.0,
                                            truncate=False))


gpt_oss_flavors: dict[str, GptOssArgs] = {
    # Tiny model for tests and smoke runs: GQA, a window of 16, YaRN over 64 original positions.
    "debugmodel": GptOssArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32, vocab_size=2048,
                             ffn_hidden_size=128, moe_hidden_size=128, num_experts=8, top_k=2, sliding_window=16,
                             max_seq_len=2048, rope_theta=150000.0,
                             rope_yarn=YarnScaling(factor=4.0, original_context=64, truncate=False)),
    "20b": _release(24, 32),  # openai/gpt-oss-20b
    "120b": _release(36, 128),  # openai/gpt-oss-120b
}
