"""Multi-head latent attention (DeepSeek-V2 §2.1, DeepSeek-V3 §2.1.1): ``MLAConfig`` and the module it builds,
the attention a DeepSeek-V3 block is given (as a Llama block is given ``attention/gqa.py``'s).

Keys and values come from one compressed latent per token: ``wkv_a`` projects x to the latent
(``kv_lora_rank``) and one rotary key (``qk_rope_head_dim``, shared by every head); the latent is
normalised (``kv_norm``) and ``wkv_b`` expands it to every head's key part without positions
(``qk_nope_head_dim``) and value (``v_head_dim``). Queries come from one projection ``wq``, or a
low-rank path ``wq_a -> q_norm -> wq_b`` when ``q_lora_rank > 0``; their last ``qk_rope_head_dim``
entries are rotated. The score of a head is ``q_nope . k_nope + q_rope . k_rope``, softmax-scaled by
``softmax_scale`` (YaRN's mscale included).

Rotation and scores are the backend's (``models/attention/backends.py``); the backends scale by
``1/sqrt(head)``, so the queries are multiplied by ``softmax_scale * sqrt(head)`` first. Under tensor
parallelism the heads are sharded (``tp_plan``: ``wq``/``wq_b`` and ``wkv_b`` column-parallel, ``wo``
row-parallel) and the latent path is whole on every rank: the shared rotary key's gradient is then a sum
over each rank's heads, which the TP group (``use_tp_group``, from ``DeepSeekV3Model.apply_tp``)
completes.

Decoding caches the normalised latent and the rotated shared key (``kv_lora_rank + qk_rope_head_dim``
values per token and layer, whatever the head count or TP degree) and expands them for every step; the
backend it is handed (the ``kv_cache`` one) attends to what they expand to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel

from torchtitan.distributed.collectives import sum_grad_over
from torchtitan.models.attention.backends import AttentionBackend, AttentionNeeds
from torchtitan.models.attention.masks import DocumentMask
from torchtitan.models.attention.max_logit import QKClipped, observe
from torchtitan.models.kv_cache import LayerCache, LayerCacheSize
from torchtitan.models.layers import RMSNorm


@dataclass(frozen=True)
class MLAConfig:
    """MLA's shape (Hugging Face's names: ``q_lora_rank`` 0 is their None) and its softmax scale."""

    dim: int
    n_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    norm_eps: float
    softmax_scale: float

    @property
    def head_dim(self) -> int:
        """The query/key head."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def build(self) -> MultiHeadLatentAttention:
        return MultiHeadLatentAttention(self)

    def needs(self, mask_type: str) -> AttentionNeeds:
        return AttentionNeeds(mask=mask_type)

    def num_params(self) -> int:
        """Projections and norms of one layer."""
        heads, q = self.n_heads, self.q_lora_rank
        query = self.dim * q + q + q * heads * self.head_dim if q else self.dim * heads * self.head_dim
        kv = self.dim * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        kv += self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        return query + kv + heads * self.v_head_dim * self.dim

    def tp_widths(self) -> list[tuple[str, int]]:
        """TP shards the heads; the latent path is whole on every rank."""
        return [("n_heads", self.n_heads)]

    def cache_size(self) -> LayerCacheSize:
        """The cache holds the normalised latent and the shared rotary key (``forward``), not the per-head keys
        and values ``expand`` makes of them."""
        return LayerCacheSize(held=self.kv_lora_rank + self.qk_rope_head_dim,
                              expanded=self.n_heads * (self.head_dim + self.v_head_dim))

    def qk_clip_refusal(self) -> str | None:
        return None  # the compressed and rotary query/key rows scale per head (MultiHeadLatentAttention)


class MultiHeadLatentAttention(QKClipped):
    """``forward(x [B, L, dim], rope_cache, *, backend, documents=None, cache=None) -> [B, L, dim]``."""

    def __init__(self, config: MLAConfig):
        super().__init__()
        c = config
        self.nope, self.rope, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.head_dim, self.kv_lora_rank = c.head_dim, c.kv_lora_rank
        self.wq: nn.Linear | None = None
        self.wq_a: nn.Linear | None = None
        self.q_norm: RMSNorm | None = None
        self.wq_b: nn.Linear | None = None
        if c.q_lora_rank:
            self.wq_a = nn.Linear(c.dim, c.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(c.q_lora_rank, c.norm_eps)
            self.wq_b = nn.Linear(c.q_lora_rank, c.n_heads * c.head_dim, bias=False)
        else:
            self.wq = nn.Linear(c.dim, c.n_heads * c.head_dim, bias=False)
        self.wkv_a = nn.Linear(c.dim, c.kv_lora_rank + c.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(c.kv_lora_rank, c.norm_eps)
        self.wkv_b = nn.Linear(c.kv_lora_rank, c.n_heads * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.wo = nn.Linear(c.n_heads * c.v_head_dim, c.dim, bias=False)
        # the backends scale by 1/sqrt(head_dim): the queries carry the rest of the softmax scale
        self.query_scale = c.softmax_scale * math.sqrt(c.head_dim)
        self.tp_group: dist.ProcessGroup | None = None  # use_tp_group
        self.register_buffer("max_logits", None, persistent=False)  # QK-clip's measurement (attention/max_logit.py)

    def clip_heads(self) -> int:
        return self.wkv_b.weight.shape[0] // (self.nope + self.v_dim)

    def clip_row_scales(self, gamma: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The query projection's rows (``[heads * (nope + rope)]``) and ``wkv_b``'s (``[heads * (nope + v_dim)]``):
        the logit ``q_nope . k_nope + q_rope . k_rope`` scales by ``gamma`` when the compressed query and key parts
        take ``sqrt(gamma)`` each and the rotary query ``gamma``; the rotary key is shared by every head (in
        ``wkv_a``) and the values do not enter the logit, so both stay as they are."""
        root = gamma.sqrt().unsqueeze(1)
        ones = torch.ones(gamma.shape[0], self.v_dim, device=gamma.device, dtype=gamma.dtype)
        query_rows = torch.cat([root.expand(-1, self.nope), gamma.unsqueeze(1).expand(-1, self.rope)], dim=1)
        key_rows = torch.cat([root.expand(-1, self.nope), ones], dim=1)
        query = self.wq if self.wq is not None else self.wq_b
        assert query is not None, "MLA has wq or wq_b"
        return [(query.weight, query_rows.flatten()), (self.wkv_b.weight, key_rows.flatten())]

    def in_projections(self) -> list[nn.Linear]:
        """The projections into the heads and the latent (init treats them alike)."""
        return [lin for lin in (self.wq, self.wq_a, self.wq_b, self.wkv_a, self.wkv_b) if lin is not None]

    def out_projections(self) -> list[nn.Linear]:
        return [self.wo]

    def tp_plan(self, seq: Shard | Replicate, tp_mesh: DeviceMesh) -> dict[str, ParallelStyle]:
        """This module's TP plan (names relative to it): heads sharded, the latent path whole. The input is
        gathered to the whole sequence and handed in as a plain tensor; each column-parallel projection sums
        its input's gradient over TP (its input is Replicate), and the shared rotary key's sum is ours
        (``use_tp_group``). A query: the module is left as it is."""
        return {"": PrepareModuleInput(input_layouts=(seq, None), desired_input_layouts=(Replicate(), None),
                                       use_local_output=True),
                "wq" if self.wq is not None else "wq_b": ColwiseParallel(), "wkv_b": ColwiseParallel(),
                "wo": RowwiseParallel(output_layouts=seq)}

    def use_tp_group(self, group: dist.ProcessGroup) -> None:
        """Under TP, after the plan: the group over which the shared rotary key's gradient is summed (every
        rank's heads read the one key)."""
        self.tp_group = group

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.wq is not None:
            return self.wq(x)
        assert self.wq_a is not None and self.q_norm is not None and self.wq_b is not None
        return self.wq_b(self.q_norm(self.wq_a(x)))

    def expand(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys [B, T, H, head_dim] and values [B, T, H, v_head_dim] of this rank's heads from the
        normalised latent [B, T, kv_lora_rank] and the rotated shared key [B, T, 1, rope]."""
        bs, length, _ = latent.shape
        kv = self.wkv_b(latent).view(bs, length, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        return k, v

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor, *, backend: AttentionBackend,
                documents: DocumentMask | None = None, cache: LayerCache | None = None) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        q = self.queries(x).view(bs, seqlen, -1, self.head_dim)  # -1: this rank's heads under TP
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.rope], dim=-1)
        latent = self.kv_norm(latent)
        q_rope, k_rope = backend.rotate(q_rope, k_rope.unsqueeze(2), rope_cache[..., :seqlen, :])
        k_rope = sum_grad_over(k_rope, self.tp_group)  # every TP rank's heads read the one rotary key
        q = torch.cat([q_nope, q_rope], dim=-1) * self.query_scale
        if cache is not None:  # the latent and the shared key are what a decoding step keeps
            latent_all, k_rope_all = cache.update(latent.unsqueeze(1), k_rope.transpose(1, 2))
            k, v = self.expand(latent_all.squeeze(1), k_rope_all.transpose(1, 2))
            out = backend.attend_cached(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), cache.mask)
        else:
            k, v = self.expand(latent, k_rope)
            if self.training:  # q_nope . k_nope + q_rope . k_rope, as the backend scores them
                observe(self.max_logits, q.transpose(1, 2), k.transpose(1, 2), documents)
            out = backend.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), documents)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))
