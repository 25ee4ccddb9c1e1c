"""The GPT-OSS model: the one decoder (``models/common/decoder.py``) whose blocks have ``SinkAttention``
(biased projections, sinks, the layer's window) and a ``MoE`` whose router has a bias and whose experts
are ``ClampedSwiGLUExperts``; its FLOPs count and TP plan (``parallel.py``: the sinks follow the heads) override
the decoder's."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

from torchtitan.distributed.init_spec import InitSpec, trunc_normal_spec
from torchtitan.models.common.config import AttentionModule, DecoderConfig
from torchtitan.models.common.decoder import Decoder, DecoderBlock
from torchtitan.models.common.flops import param_counts
from torchtitan.models.gpt_oss.args import GptOssArgs
from torchtitan.models.gpt_oss.attention import SinkAttention
from torchtitan.models.gpt_oss.parallel import shard_sinks
from torchtitan.models.moe import MoE
from torchtitan.models.moe.experts import ClampedSwiGLUExperts


def _gpt_oss(args: DecoderConfig) -> GptOssArgs:
    if not isinstance(args, GptOssArgs):
        raise TypeError(f"{type(args).__name__} is not GPT-OSS's arguments")
    return args


class GptOssMoE(MoE):
    """The shared ``MoE`` (routing, dispatch, balancing) with GPT-OSS's biased, clamped experts."""

    def __init__(self, args: GptOssArgs):
        super().__init__(args.moe_args())
        self.experts = ClampedSwiGLUExperts(args.dim, args.moe_hidden_size, args.num_experts, args.swiglu_limit,
                                            args.swiglu_alpha, args.use_grouped_mm)

    def param_init_specs(self, std: float = 0.02, out_std: float | None = None) -> dict[str, InitSpec]:
        """``MoE``'s, with the router's and the experts' biases drawn like their weights' inputs: small and
        non-zero, so that every layout test sees a bias that is added twice."""
        specs = super().param_init_specs(std, out_std)
        bias = trunc_normal_spec(std, 2.0)
        specs.update({"router.gate.bias": bias, "experts.w1_bias": bias, "experts.w3_bias": bias,
                      "experts.w2_bias": bias})
        return specs


class GptOssBlock(DecoderBlock):
    """The decoder's block with the layer's sink attention (windowed on the layers ``layer_types`` names)
    and GPT-OSS's MoE."""

    def build_attention(self, layer_id: int, args: DecoderConfig) -> AttentionModule:
        return _gpt_oss(args).layer_attention(layer_id).build()

    def build_moe(self, args: DecoderConfig) -> MoE:
        return GptOssMoE(_gpt_oss(args))


class GptOssModel(Decoder):
    """``Decoder`` of ``GptOssBlock``; the attention's biases and sinks initialised beside the decoder's rules."""

    block_type = GptOssBlock

    @classmethod
    def flops_per_token(cls, args: DecoderConfig, seq_len: int) -> float:
        return flops_per_token(_gpt_oss(args), seq_len)

    def apply_tp(self, tp_mesh: DeviceMesh, sequence_parallel: bool, loss_parallel: bool) -> None:
        """The decoder's plan (the attention module's own included), then the sinks sharded with the heads."""
        super().apply_tp(tp_mesh, sequence_parallel, loss_parallel)
        shard_sinks(self, tp_mesh)

    def extra_init_specs(self) -> dict[int, InitSpec]:
        """The attention's biases and sinks trunc_normal(0.02) (the sinks so they matter from the first step)."""
        small = trunc_normal_spec(0.02, 2.0)
        specs: dict[int, InitSpec] = {}
        for block in self.blocks():
            attention = block.attention
            if isinstance(attention, SinkAttention):
                for t in (*attention.biases(), attention.sinks):
                    specs[id(t)] = small
        return specs


def flops_per_token(args: GptOssArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6 * N_active (the decoder's count with the attention's biases and sinks,
    plus the chosen experts' biases) and the attention scores 12 * (n_heads * head_dim) * the keys a query
    sees, summed over the layers: a sliding layer sees at most its window."""
    _, active = param_counts(args)
    active += args.n_layers * (args.num_experts + args.top_k * (2 * args.moe_hidden_size + args.dim))
    n = active - args.vocab_size * args.dim  # the embedding lookup does no matmul
    keys = sum(min(seq_len, w) if (w := args.window(i)) is not None else seq_len for i in range(args.n_layers))
    return 6.0 * n + 12.0 * args.n_heads * args.head_dim * keys


__all__ = ["GptOssBlock", "GptOssMoE", "GptOssModel", "flops_per_token"]
