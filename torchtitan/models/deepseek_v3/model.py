"""DeepSeek-V3's decoder: the shared decoder (``models/common/decoder.py``) with MLA blocks, dense
feed-forwards in the first ``first_k_dense_replace`` layers and MoE with shared experts after them."""

from __future__ import annotations

import math

import torch
from torch import nn

from torchtitan.distributed.init_spec import InitSpec, trunc_normal_spec
from torchtitan.models.attention import DocumentMask
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.common.moe_decoder import MoEDecoder
from torchtitan.models.deepseek_v3.args import DeepSeekV3Args
from torchtitan.models.deepseek_v3.mla import MultiHeadLatentAttention
from torchtitan.models.deepseek_v3.mtp import MTPModule, depth_inputs
from torchtitan.models.kv_cache import KVCache, LayerCache
from torchtitan.models.layers import FeedForward, RMSNorm, precompute_rope_cache
from torchtitan.models.moe import MoE


class DeepSeekV3Block(nn.Module):
    """Pre-norm MLA, then pre-norm SwiGLU (dense layers) or MoE (named ``feed_forward`` either way)."""

    def __init__(self, layer_id: int, args: DeepSeekV3Args):
        super().__init__()
        self.layer_id = layer_id  # kept so depth-scaled init survives pipeline pruning
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = MultiHeadLatentAttention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.moe = args.is_moe_layer(layer_id)
        self.feed_forward: MoE | FeedForward = (MoE(args.moe_args()) if self.moe
                                                else FeedForward(args.dim, args.ffn_hidden_size))

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor, documents: DocumentMask | None = None,
                cache: LayerCache | None = None) -> torch.Tensor:
        # Keywords: tensor parallelism lays out the positional inputs of attention only.
        h = x + self.attention(self.attention_norm(x), rope_cache, documents=documents, cache=cache)
        return h + self.feed_forward(self.ffn_norm(h))


def block_init_specs(block: DeepSeekV3Block, depth: int) -> dict[int, InitSpec]:
    """id(parameter) -> InitSpec for one block: norms ones, in-projections trunc_normal(0.02), the
    out-projections (wo, w2) depth-scaled, as the other decoders."""
    out_std = 0.02 / math.sqrt(2 * depth)
    in_spec, out_spec = trunc_normal_spec(0.02, 2.0), trunc_normal_spec(out_std, 2.0)
    specs: dict[int, InitSpec] = {}
    for module in block.modules():
        if isinstance(module, RMSNorm):
            specs[id(module.weight)] = InitSpec("ones")
    attn, ffn = block.attention, block.feed_forward
    for lin in (attn.wq, attn.wq_a, attn.wq_b, attn.wkv_a, attn.wkv_b):
        if lin is not None:
            specs[id(lin.weight)] = in_spec
    specs[id(attn.wo.weight)] = out_spec
    if isinstance(ffn, MoE):
        for name, spec in ffn.param_init_specs(0.02, out_std).items():
            specs[id(ffn.get_parameter(name))] = spec
    else:
        specs[id(ffn.w1.weight)] = specs[id(ffn.w3.weight)] = in_spec
        specs[id(ffn.w2.weight)] = out_spec
    return specs


class DeepSeekV3Model(MoEDecoder):
    """``Decoder`` of ``DeepSeekV3Block``; the rotary cache covers ``qk_rope_head_dim`` only, YaRN-scaled."""

    args: DeepSeekV3Args

    def __init__(self, args: DeepSeekV3Args):
        Decoder.__init__(self, args, DeepSeekV3Block)
        # Multi-token prediction (mtp.py): depth k's block is layer n_layers + k - 1, as releases number it.
        self.mtp: nn.ModuleDict | None = None
        if args.num_mtp_layers:
            self.mtp = nn.ModuleDict({str(k): MTPModule(DeepSeekV3Block(args.n_layers + k, args), args)
                                      for k in range(args.num_mtp_layers)})
        self._mtp_outputs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, cache: KVCache | None = None,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder's forward; with ``labels`` (training with multi-token prediction) it also keeps each
        depth's (logits, labels) for ``pop_mtp_outputs``. Returns the main logits either way."""
        if labels is None or self.mtp is None or cache is not None:
            return super().forward(tokens, positions, cache)
        assert self.tok_embeddings is not None and self.norm is not None and self.output is not None, (
            "multi-token prediction needs the whole model (preflight refuses it under pipeline parallelism)")
        h = self.tok_embeddings(tokens)
        rope = self.rope_cache if positions is None else self.rope_cache[positions]
        documents = None
        if self.args.attn_mask_type == "block_causal" and positions is not None:
            documents = self.document_mask(positions, tokens.shape[0])
        for layer in self.layers.values():
            h = layer(h, rope, documents=documents)
        self._mtp_outputs = []
        previous = h
        for k, module in enumerate(self.mtp.values(), start=1):
            assert isinstance(module, MTPModule)
            ids, targets = depth_inputs(tokens, labels, k)
            previous = module(previous, self.tok_embeddings(ids), rope, documents)
            self._mtp_outputs.append((self.output(module.norm(previous)), targets))
        return self.output(self.norm(h))

    def extra_blocks(self) -> list[nn.Module]:
        """The blocks that run after ``layers`` (the MTP modules): FSDP makes each its own unit."""
        return list(self.mtp.values()) if self.mtp is not None else []

    def moe_layers(self) -> dict[str, MoE]:
        """Layer key -> MoE, the MTP modules' included (``mtp.k``): balancing and EP go through them all."""
        layers = super().moe_layers()
        for k, module in (self.mtp or {}).items():
            assert isinstance(module, MTPModule) and isinstance(module.block, DeepSeekV3Block)
            if isinstance(module.block.feed_forward, MoE):
                layers[f"mtp.{k}"] = module.block.feed_forward
        return layers

    def pop_mtp_outputs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each depth's (logits [B, L, vocab], labels [B, L]) of the last forward given labels; cleared."""
        out, self._mtp_outputs = self._mtp_outputs, []
        return out

    def _rope_cache(self, device: torch.device | None) -> torch.Tensor:
        a = self.args
        return precompute_rope_cache(a.qk_rope_head_dim, a.max_seq_len, a.rope_theta, a.yarn, device)

    def param_init_specs(self) -> dict[str, InitSpec]:
        """FQN -> InitSpec: ``block_init_specs`` for each block; embedding normal(0, 1); output
        trunc_normal(dim**-0.5, cut at +-3 std)."""
        args = self.args
        by_param: dict[int, InitSpec] = {}
        for block in self.layers.values():
            assert isinstance(block, DeepSeekV3Block)
            by_param.update(block_init_specs(block, block.layer_id + 1 if args.depth_init else args.n_layers))
        for module in (self.mtp or {}).values():
            assert isinstance(module, MTPModule) and isinstance(module.block, DeepSeekV3Block)
            by_param.update(block_init_specs(module.block, module.block.layer_id + 1 if args.depth_init
                                             else args.n_layers))
            for norm in (module.enorm, module.hnorm, module.norm):
                by_param[id(norm.weight)] = InitSpec("ones")
            by_param[id(module.eh_proj.weight)] = trunc_normal_spec(0.02, 2.0)
        if self.norm is not None:
            by_param[id(self.norm.weight)] = InitSpec("ones")
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


def mla_params(args: DeepSeekV3Args) -> int:
    """Parameters of one MLA layer (its norms included)."""
    heads = args.n_heads
    q = (args.dim * args.q_lora_rank + args.q_lora_rank + args.q_lora_rank * heads * args.head_dim
         if args.q_lora_rank else args.dim * heads * args.head_dim)
    kv = args.dim * (args.kv_lora_rank + args.qk_rope_head_dim) + args.kv_lora_rank
    kv += args.kv_lora_rank * heads * (args.qk_nope_head_dim + args.v_head_dim)
    return q + kv + heads * args.v_head_dim * args.dim


def param_counts(args: DeepSeekV3Args) -> tuple[int, int]:
    """(total, active per token) parameters of the main model (MTP modules apart), embedding and output included."""
    attn = mla_params(args) + 2 * args.dim
    dense = 3 * args.dim * args.ffn_hidden_size
    expert = 3 * args.dim * args.moe_hidden_size
    total = active = 0
    for i in range(args.n_layers):
        if args.is_moe_layer(i):
            shared = args.num_shared_experts * expert
            total += attn + args.num_experts * expert + shared + args.dim * args.num_experts
            active += attn + args.top_k * expert + shared + args.dim * args.num_experts
        else:
            total += attn + dense
            active += attn + dense
    ends = args.dim + 2 * args.vocab_size * args.dim
    return total + ends, active + ends


def flops_per_token(args: DeepSeekV3Args, seq_len: int) -> float:
    """Training FLOPs per token: 6 * N_active (the lookup apart) + 6 * n_layers * n_heads * (head_dim +
    v_head_dim) * seq_len, the scores QK^T (query/key head) and AV (value head) forward and backward:
    Llama 3's 12 * n_layers * n_heads * head_dim * seq_len when the two heads are equal."""
    _, active = param_counts(args)
    n = active - args.vocab_size * args.dim
    return 6.0 * n + 6.0 * args.n_layers * args.n_heads * (args.head_dim + args.v_head_dim) * seq_len
