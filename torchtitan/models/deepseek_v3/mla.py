"""Multi-head latent attention (DeepSeek-V2 §2.1, DeepSeek-V3 §2.1.1).

Keys and values come from one compressed latent per token: ``wkv_a`` projects x to the latent
(``kv_lora_rank``) and one rotary key (``qk_rope_head_dim``, shared by every head); the latent is
normalised (``kv_norm``) and ``wkv_b`` expands it to every head's key part without positions
(``qk_nope_head_dim``) and value (``v_head_dim``). Queries come from one projection ``wq``, or a
low-rank path ``wq_a -> q_norm -> wq_b`` when ``q_lora_rank > 0``; their last ``qk_rope_head_dim``
entries are rotated. The score of a head is ``q_nope . k_nope + q_rope . k_rope``, softmax-scaled by
``args.softmax_scale()`` (YaRN's mscale included).

The score kernels are the shared ones (``models/attention.py``: causal SDPA, the document mask, or a
backend such as context parallelism's); they take the default ``1/sqrt(head)`` scale, so the queries
are multiplied by ``softmax_scale * sqrt(head)`` first. Under tensor parallelism the heads are sharded
(``wq``/``wq_b`` and ``wkv_b`` column-parallel, ``wo`` row-parallel) and the latent path is whole on
every rank (``deepseek_v3/parallel.py``): the shared rotary key's gradient is then a sum over each rank's
heads, which ``tp_group`` completes.

Decoding caches the normalised latent and the rotated shared key (``kv_lora_rank + qk_rope_head_dim``
values per token and layer, whatever the head count or TP degree) and expands them for every step.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from torchtitan.models.attention import AttentionBackend, DocumentMask, block_causal_attention
from torchtitan.models.deepseek_v3.args import DeepSeekV3Args
from torchtitan.models.kv_cache import LayerCache
from torchtitan.models.layers import RMSNorm, apply_rotary_emb


class _SumGradOverGroup(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over ``group`` (the heads of every TP rank)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # noqa: ANN001
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class MultiHeadLatentAttention(nn.Module):
    """``forward(x [B, L, dim], rope_cache, documents=None, cache=None) -> [B, L, dim]`` (see the module docstring).

    ``rope_cache``: the decoder's rotary cache of ``qk_rope_head_dim`` (YaRN-scaled), sliced to the
    forward's positions; ``documents``: the block-causal mask of this forward (None: causal);
    ``cache``: decoding's layer cache.
    """

    def __init__(self, args: DeepSeekV3Args):
        super().__init__()
        dim, heads = args.dim, args.n_heads
        self.nope, self.rope, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.head_dim, self.kv_lora_rank = args.head_dim, args.kv_lora_rank
        self.wq: nn.Linear | None = None
        self.wq_a: nn.Linear | None = None
        self.q_norm: RMSNorm | None = None
        self.wq_b: nn.Linear | None = None
        if args.q_lora_rank:
            self.wq_a = nn.Linear(dim, args.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(args.q_lora_rank, args.norm_eps)
            self.wq_b = nn.Linear(args.q_lora_rank, heads * self.head_dim, bias=False)
        else:
            self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wkv_a = nn.Linear(dim, self.kv_lora_rank + self.rope, bias=False)
        self.kv_norm = RMSNorm(self.kv_lora_rank, args.norm_eps)
        self.wkv_b = nn.Linear(self.kv_lora_rank, heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(heads * self.v_dim, dim, bias=False)
        # the kernels scale by 1/sqrt(head_dim): the queries carry the rest of the softmax scale
        self.query_scale = args.softmax_scale() * math.sqrt(self.head_dim)
        self.backend: AttentionBackend | None = None  # set by context parallelism (models/attention.py)
        self.tp_group: dist.ProcessGroup | None = None  # set by tensor parallelism (deepseek_v3/parallel.py)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.wq is not None:
            return self.wq(x)
        assert self.wq_a is not None and self.q_norm is not None and self.wq_b is not None
        return self.wq_b(self.q_norm(self.wq_a(x)))

    def rotary(self, xq: torch.Tensor, xk: torch.Tensor, rope_cache: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate the rotary parts (adjacent pairs, DeepSeek's layout); a CPU kernel may stand in."""
        return apply_rotary_emb(xq, xk, rope_cache)

    def sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of whole sequences: q, k [B, H, L, head_dim]; v [B, H, L, v_head_dim]."""
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def expand(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys [B, T, H, head_dim] and values [B, T, H, v_head_dim] of this rank's heads from the
        normalised latent [B, T, kv_lora_rank] and the rotated shared key [B, T, 1, rope]."""
        bs, length, _ = latent.shape
        kv = self.wkv_b(latent).view(bs, length, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        return k, v

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor, documents: DocumentMask | None = None,
                cache: LayerCache | None = None) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        q = self.queries(x).view(bs, seqlen, -1, self.head_dim)  # -1: this rank's heads under TP
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.rope], dim=-1)
        latent = self.kv_norm(latent)
        q_rope, k_rope = self.rotary(q_rope, k_rope.unsqueeze(2), rope_cache[..., :seqlen, :])
        if self.tp_group is not None:
            k_rope = _SumGradOverGroup.apply(k_rope, self.tp_group)
        q = torch.cat([q_nope, q_rope], dim=-1) * self.query_scale
        if cache is not None:  # the latent and the shared key are what a decoding step keeps
            latent_all, k_rope_all = cache.update(latent.unsqueeze(1), k_rope.transpose(1, 2))
            k, v = self.expand(latent_all.squeeze(1), k_rope_all.transpose(1, 2))
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 attn_mask=cache.mask)
            return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))
        k, v = self.expand(latent, k_rope)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.backend is not None:
            out = self.backend.causal(q, k, v) if documents is None else self.backend.block_causal(q, k, v, documents)
        else:
            out = self.sdpa(q, k, v) if documents is None else block_causal_attention(q, k, v, documents)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))
