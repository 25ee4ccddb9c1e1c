"""DeepSeek-V3's model: the one decoder (``models/common/decoder.py``) with MLA as its blocks' attention
(``args.attention()``), the rotary cache over ``qk_rope_head_dim`` (YaRN-scaled), and the multi-token
prediction modules (``mtp.py``) after the blocks. As the family's class it overrides the decoder's FLOPs count,
checks (``parallel.py``), job options (``--model.mtp_*``), TP plan (MLA's TP group) and pipeline split (the MTP
modules and a copy of the embedding on the last stage)."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from torchtitan.config import job_config
from torchtitan.distributed.init_spec import InitSpec, trunc_normal_spec
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.common.config import DecoderConfig
from torchtitan.models.common.decoder import Decoder, DecoderBlock
from torchtitan.models.common.flops import param_counts
from torchtitan.models.deepseek_v3.args import DeepSeekV3Args
from torchtitan.models.deepseek_v3.mla import MultiHeadLatentAttention
from torchtitan.models.deepseek_v3.mtp import MTPModule, depth_tokens
from torchtitan.models.deepseek_v3.parallel import mtp_problems
from torchtitan.models.kv_cache import KVCache
from torchtitan.models.layers import precompute_rope_cache
from torchtitan.models.moe import MoE

__all__ = ["DeepSeekV3Model", "flops_per_token", "param_counts"]


class DeepSeekV3Model(Decoder):
    """``Decoder`` of MLA blocks, with ``mtp`` (None when off): depth k's module is keyed, and its block
    numbered, ``n_layers + k - 1``, the layer index a release stores it under (``model.layers.61`` in the 671B)."""

    args: DeepSeekV3Args
    release_holds_routing_bias = True  # the release's e_score_correction_bias

    def __init__(self, args: DeepSeekV3Args):
        super().__init__(args)
        self.mtp: nn.ModuleDict | None = None
        if args.num_mtp_layers:
            self.mtp = nn.ModuleDict({str(args.n_layers + k): MTPModule(DecoderBlock(args.n_layers + k, args), args)
                                      for k in range(args.num_mtp_layers)})

    # ---------------------------------------------------------------- where the family differs from the decoder

    @classmethod
    def flops_per_token(cls, args: DecoderConfig, seq_len: int) -> float:
        return flops_per_token(_deepseek_v3(args), seq_len)

    @classmethod
    def check(cls, args: DecoderConfig, dims: ParallelDims, model: job_config.Model,
              parallelism: job_config.Parallelism) -> list[str]:
        """The decoder's problems, and the layouts multi-token prediction cannot run in, one line each."""
        problems = super().check(args, dims, model, parallelism)
        if args.mtp_depths:
            problems += mtp_problems(args.mtp_depths, dims, parallelism)
        return problems

    @classmethod
    def with_job_options(cls, args: DecoderConfig, model: job_config.Model, moe: job_config.Moe) -> DecoderConfig:
        """The decoder's [moe] balancing, and the multi-token prediction options (``--model.mtp_*``)."""
        args = super().with_job_options(args, model, moe)
        return dataclasses.replace(args, num_mtp_layers=model.mtp_layers, mtp_loss_weight=model.mtp_loss_weight)

    def apply_tp(self, tp_mesh: DeviceMesh, sequence_parallel: bool, loss_parallel: bool) -> None:
        """The decoder's TP plan (MLA's part from its ``tp_plan``), then every MLA, the MTP blocks' included, sums
        its shared rotary key's gradient over ``tp_mesh``."""
        super().apply_tp(tp_mesh, sequence_parallel, loss_parallel)
        group = tp_mesh.get_group()
        for module in self.modules():
            if isinstance(module, MultiHeadLatentAttention):
                module.use_tp_group(group)

    def prune_stage(self, layers: range, first: bool, last: bool) -> None:
        """The decoder's pruning, with the MTP modules on the last stage only; there they read the embedding, so
        the last stage keeps a copy of it (distributed/stage_copies.py keeps the two equal), its input still the
        previous stage's hidden states."""
        embedding = self.tok_embeddings
        super().prune_stage(layers, first, last)
        if not last:
            self.mtp = None
        elif self.mtp is not None and not first:
            self.tok_embeddings, self.input_is_hidden = embedding, True

    def mtp_objective(self) -> tuple[int, float]:
        depths = self.args.num_mtp_layers
        return (depths, self.args.mtp_loss_weight) if depths else (0, 0.0)

    def fused_row_parts(self) -> dict[torch.Tensor, tuple[int, ...]]:
        """MLA's ``wkv_a`` stacks the compressed key-value projection and the shared rotary key."""
        return {m.wkv_a.weight: (m.kv_lora_rank, m.rope) for m in self.modules()
                if isinstance(m, MultiHeadLatentAttention)}

    def head_row_parts(self) -> dict[torch.Tensor, tuple[int, ...]]:
        """MLA's per-head weights in their heads' rows: the query (``wq``, or ``wq_b`` after the low-rank
        path) a part of ``qk_nope + qk_rope`` rows per head; ``wkv_b`` two parts per head, its ``qk_nope`` key
        rows then its ``v_head_dim`` value rows: the head's key and value are two maps of the latent (as
        ``wk`` and ``wv`` are in grouped-query attention), so each is orthogonalized alone. The shared
        projections (``wq_a``, ``wkv_a``) have no heads."""
        parts: dict[torch.Tensor, tuple[int, ...]] = {}
        for m in self.modules():
            if isinstance(m, MultiHeadLatentAttention):
                query = m.wq if m.wq is not None else m.wq_b
                assert query is not None, "MLA has wq or, with q_lora_rank, wq_b"
                heads = m.wkv_b.weight.shape[0] // (m.nope + m.v_dim)  # the global shape, a DTensor's too
                parts[query.weight] = (m.head_dim,) * heads
                parts[m.wkv_b.weight] = (m.nope, m.v_dim) * heads
        return parts

    # ---------------------------------------------------------------- the model

    def _rope_cache(self, device: torch.device | None) -> torch.Tensor:
        a = self.args
        return precompute_rope_cache(a.qk_rope_head_dim, a.max_seq_len, a.rope_theta, a.yarn, device)

    def extra_blocks(self) -> list[DecoderBlock]:
        """The MTP modules' blocks run after ``layers``: each its own FSDP unit, with the TP plan of a block."""
        return [m.block for m in self._mtp_modules() if isinstance(m.block, DecoderBlock)]

    def extra_tp_plan(self, seq: Shard | Replicate) -> dict[str, ParallelStyle]:
        """Under sequence parallelism the MTP modules' norms and ``eh_proj`` take this rank's sequence shard
        with their weights replicated (their gradients summed over TP, as a block's norms'); ``eh_proj`` hands
        its block a plain tensor, as the blocks hand each other (``MTPModule._project`` multiplies the local rows:
        the plan only replicates its weight). Replicated activations need no plan: every TP
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


def _deepseek_v3(args: DecoderConfig) -> DeepSeekV3Args:
    if not isinstance(args, DeepSeekV3Args):
        raise TypeError(f"{type(args).__name__} is not DeepSeek-V3's arguments")
    return args


def flops_per_token(args: DeepSeekV3Args, seq_len: int) -> float:
    """Training FLOPs per token: 6 * N_active (the lookup apart) + 6 * n_layers * n_heads * (head_dim +
    v_head_dim) * seq_len, the scores QK^T (query/key head) and AV (value head) forward and backward:
    Llama 3's 12 * n_layers * n_heads * head_dim * seq_len when the two heads are equal."""
    _, active = param_counts(args)
    n = active - args.vocab_size * args.dim
    return 6.0 * n + 6.0 * args.n_layers * args.n_heads * (args.head_dim + args.v_head_dim) * seq_len
