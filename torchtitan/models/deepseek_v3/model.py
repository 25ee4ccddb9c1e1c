"""DeepSeek-V3's model: the one decoder (``models/common/decoder.py``) with MLA as its blocks' attention
(``args.attention()``), the rotary cache over ``qk_rope_head_dim`` (YaRN-scaled), and the multi-token
prediction modules (``mtp.py``) after the blocks."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from torchtitan.distributed.init_spec import InitSpec, trunc_normal_spec
from torchtitan.models.common.decoder import Decoder, DecoderBlock
from torchtitan.models.common.flops import param_counts
from torchtitan.models.deepseek_v3.args import DeepSeekV3Args
from torchtitan.models.deepseek_v3.mtp import MTPModule, depth_tokens
from torchtitan.models.kv_cache import KVCache
from torchtitan.models.layers import precompute_rope_cache
from torchtitan.models.moe import MoE

__all__ = ["DeepSeekV3Model", "flops_per_token", "param_counts"]


class DeepSeekV3Model(Decoder):
    """``Decoder`` of MLA blocks, with ``mtp`` (None when off): depth k's module is keyed, and its block
    numbered, ``n_layers + k - 1``, the layer index a release stores it under (``model.layers.61`` in the 671B)."""

    args: DeepSeekV3Args

    def __init__(self, args: DeepSeekV3Args):
        super().__init__(args)
        self.mtp: nn.ModuleDict | None = None
        if args.num_mtp_layers:
            self.mtp = nn.ModuleDict({str(args.n_layers + k): MTPModule(DecoderBlock(args.n_layers + k, args), args)
                                      for k in range(args.num_mtp_layers)})

    def _rope_cache(self, device: torch.device | None) -> torch.Tensor:
        a = self.args
        return precompute_rope_cache(a.qk_rope_head_dim, a.max_seq_len, a.rope_theta, a.yarn, device)

    def extra_blocks(self) -> list[DecoderBlock]:
        """The MTP modules' blocks run after ``layers``: each its own FSDP unit, with the TP plan of a block."""
        return [m.block for m in self._mtp_modules() if isinstance(m.block, DecoderBlock)]

    def extra_tp_plan(self, seq: Shard | Replicate) -> dict[str, ParallelStyle]:
        """Under sequence parallelism the MTP modules' norms and ``eh_proj`` take this rank's sequence shard
        with their weights replicated (their gradients summed over TP, as a block's norms'); ``eh_proj`` hands
        its block a plain tensor, as the blocks hand each other. Replicated activations need no plan: every TP
        rank computes the whole, the same."""
        if not isinstance(seq, Shard):
            return {}
        plan: dict[str, ParallelStyle] = {}
        for key in (self.mtp or {}):
            plan.update({f"mtp.{key}.{norm}": SequenceParallel() for norm in ("enorm", "hnorm", "norm")})
            plan[f"mtp.{key}.eh_proj"] = SequenceParallel(use_local_output=True)
        return plan

    def _mtp_modules(self) -> list[MTPModule]:
        return [m for m in (self.mtp or {}).values() if isinstance(m, MTPModule)]

    def moe_layers(self) -> dict[str, MoE]:
        """Layer key -> MoE, the MTP modules' included (``mtp.<layer>``): balancing and EP go through them all."""
        layers = super().moe_layers()
        for key, module in (self.mtp or {}).items():
            if isinstance(module, MTPModule) and isinstance(module.block.feed_forward, MoE):
                layers[f"mtp.{key}"] = module.block.feed_forward
        return layers

    def extra_init_specs(self) -> dict[int, InitSpec]:
        """The MTP modules' ``eh_proj`` trunc_normal(0.02); their blocks and norms follow the decoder's rules."""
        return {id(m.eh_proj.weight): trunc_normal_spec(0.02, 2.0) for m in self._mtp_modules()}

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, cache: KVCache | None = None,
                mtp_tokens: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The decoder's forward. With ``mtp_tokens`` (training with multi-token prediction: the batch's input
        ids [B, L], which a pipeline's last stage gets as this keyword beside the hidden states it receives),
        the model, or the stage holding the output, returns ``(logits, depth 1's logits, ..., depth D's)``;
        ``train_step/mtp.py`` scores them. Else the main logits (hidden states on a stage without the output)."""
        if mtp_tokens is None or self.mtp is None or cache is not None or self.output is None:
            return super().forward(tokens, positions, cache)
        assert self.tok_embeddings is not None and self.norm is not None, (
            "the stage with the output holds the final norm and, for multi-token prediction, the embedding")
        run = self.run_blocks(tokens, positions)
        outputs, previous = [self.output(self.norm(run.hidden))], run.hidden
        for k, module in enumerate(self._mtp_modules(), start=1):
            future = self.tok_embeddings(depth_tokens(mtp_tokens, k))
            previous = module(previous, future, run.rope, backend=run.backend, documents=run.documents)
            outputs.append(self.output(module.norm(previous)))
        return tuple(outputs)


def flops_per_token(args: DeepSeekV3Args, seq_len: int) -> float:
    """Training FLOPs per token: 6 * N_active (the lookup apart) + 6 * n_layers * n_heads * (head_dim +
    v_head_dim) * seq_len, the scores QK^T (query/key head) and AV (value head) forward and backward:
    Llama 3's 12 * n_layers * n_heads * head_dim * seq_len when the two heads are equal."""
    _, active = param_counts(args)
    n = active - args.vocab_size * args.dim
    return 6.0 * n + 6.0 * args.n_layers * args.n_heads * (args.head_dim + args.v_head_dim) * seq_len
