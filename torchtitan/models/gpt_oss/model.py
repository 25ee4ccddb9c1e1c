"""The GPT-OSS model: the shared ``Decoder`` of pre-norm blocks, each ``SinkAttention`` then a ``MoE`` whose
router has a bias and whose experts are ``ClampedSwiGLUExperts``."""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import nn

from torchtitan.distributed.init_spec import InitSpec, trunc_normal_spec
from torchtitan.models.attention import DocumentMask
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.common.moe_decoder import param_counts
from torchtitan.models.gpt_oss.args import GptOssArgs
from torchtitan.models.gpt_oss.attention import SinkAttention
from torchtitan.models.kv_cache import LayerCache
from torchtitan.models.layers import RMSNorm
from torchtitan.models.moe import MoE
from torchtitan.models.moe.experts import ClampedSwiGLUExperts


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


class GptOssBlock(nn.Module):
    """Pre-norm sink attention (windowed on the layers ``layer_types`` names), then pre-norm MoE."""

    def __init__(self, layer_id: int, args: GptOssArgs):
        super().__init__()
        self.layer_id = layer_id  # kept so depth-scaled init survives pipeline pruning
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = SinkAttention(args.dim, args.n_heads, args.n_kv_heads, args.head_dim, args.window(layer_id))
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = GptOssMoE(args)

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor, documents: DocumentMask | None = None,
                cache: LayerCache | None = None) -> torch.Tensor:
        # Keywords: tensor parallelism lays out the positional inputs of attention only.
        h = x + self.attention(self.attention_norm(x), rope_cache, documents=documents, cache=cache)
        return h + self.feed_forward(self.ffn_norm(h))


class GptOssModel(Decoder):
    """``Decoder`` of ``GptOssBlock``."""

    def __init__(self, args: GptOssArgs):
        super().__init__(args, GptOssBlock)

    def moe_layers(self) -> dict[str, MoE]:
        return {k: cast(GptOssBlock, b).feed_forward for k, b in self.layers.items()}

    def param_init_specs(self) -> dict[str, InitSpec]:
        """The shared MoE decoder's scheme (``MoEDecoder.param_init_specs``) with the attention's biases
        trunc_normal(0.02) and the sinks trunc_normal(0.02) (so they matter from the first step)."""
        args = self.args
        by_param: dict[int, InitSpec] = {}
        small = trunc_normal_spec(0.02, 2.0)
        for module in self.modules():
            if isinstance(module, RMSNorm):
                by_param[id(module.weight)] = InitSpec("ones")
            elif isinstance(module, GptOssBlock):
                depth = module.layer_id + 1 if args.depth_init else args.n_layers
                out_std = 0.02 / math.sqrt(2 * depth)
                attn, moe = module.attention, module.feed_forward
                for lin in (attn.wq, attn.wk, attn.wv):
                    by_param[id(lin.weight)] = small
                by_param[id(attn.wo.weight)] = trunc_normal_spec(out_std, 2.0)
                for lin in (attn.wq, attn.wk, attn.wv, attn.wo):
                    by_param[id(lin.bias)] = small
                by_param[id(attn.sinks)] = small
                for name, spec in moe.param_init_specs(0.02, out_std).items():
                    by_param[id(moe.get_parameter(name))] = spec
        if self.tok_embeddings is not None:
            by_param[id(self.tok_embeddings.weight)] = InitSpec("normal", std=1.0)
        if self.output is not None:
            by_param[id(self.output.weight)] = trunc_normal_spec(args.dim**-0.5, 3.0)
        specs: dict[str, InitSpec] = {}
        for fqn, param in self.named_parameters():
            if id(param) not in by_param:
                raise RuntimeError(f"no init spec for parameter {fqn}")
            specs[fqn] = by_param[id(param)]
        return specs

    @torch.no_grad()
    def init_buffers(self, buffer_device: torch.device | None = None) -> None:
        """The rotary cache, and each MoE's counts (and router bias) zeroed."""
        super().init_buffers(buffer_device)
        for moe in self.moe_layers().values():
            moe.init_buffers()


def flops_per_token(args: GptOssArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6 * N_active (the shared decoder's count, plus the biases) and the attention
    scores 12 * (n_heads * head_dim) * the keys a query sees, summed over the layers: a sliding layer sees at
    most its window (the full ``seq_len`` otherwise, as the shared decoder counts it)."""
    _, active = param_counts(args)
    biases = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim + args.dim  # q/k/v/o
    biases += args.num_experts + args.top_k * (2 * args.moe_hidden_size + args.dim)  # router, chosen experts
    active += args.n_layers * biases
    n = active - args.vocab_size * args.dim  # the embedding lookup does no matmul
    keys = sum(min(seq_len, w) if (w := args.window(i)) is not None else seq_len for i in range(args.n_layers))
    return 6.0 * n + 12.0 * args.n_heads * args.head_dim * keys
