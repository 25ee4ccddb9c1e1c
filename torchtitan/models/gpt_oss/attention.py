"""GPT-OSS attention: grouped-query attention with biased projections, a learned sink logit per head, and
a sliding window on the layers the config names.

The module passes its sinks and window to the backend it is handed as ``ScoreExtras``, in training and in
decoding alike; every backend applies both (the kernels are ``models/attention/kernels.py``), so what
``SinkAttentionConfig`` needs of a backend is the mask alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from torchtitan.models.attention import (
    AttentionBackend,
    AttentionNeeds,
    DocumentMask,
    GQAConfig,
    GroupedQueryAttention,
    ScoreExtras,
)
from torchtitan.models.attention.max_logit import observe
from torchtitan.models.kv_cache import LayerCache, LayerCacheSize


@dataclass(frozen=True)
class SinkAttentionConfig:
    """Grouped-query attention (``GQAConfig``'s widths) with biases and sinks; ``window``: this layer's sliding
    window (None: full)."""

    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    window: int | None = None

    def build(self) -> SinkAttention:
        return SinkAttention(self)

    def needs(self, mask_type: str) -> AttentionNeeds:
        return AttentionNeeds(mask=mask_type)

    def num_params(self) -> int:
        """Projections (weights and biases) and the sinks of one layer."""
        gqa = GQAConfig(self.dim, self.n_heads, self.n_kv_heads, self.head_dim)
        biases = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim + self.dim
        return gqa.num_params() + biases + self.n_heads

    def tp_widths(self) -> list[tuple[str, int]]:
        return [("n_heads", self.n_heads), ("n_kv_heads", self.n_kv_heads)]

    def cache_size(self) -> LayerCacheSize:
        """Grouped-query attention's keys and values; the cache keeps every slot, the window masks them."""
        keys_and_values = 2 * self.n_kv_heads * self.head_dim
        return LayerCacheSize(held=keys_and_values, expanded=keys_and_values, window=self.window)

    def qk_clip_refusal(self) -> str | None:
        return None  # the query rows and their bias scale per head; the sinks are not logits of a key


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's heads of a per-head parameter (tensor parallelism shards it with the heads)."""
    return t.to_local() if isinstance(t, DTensor) else t


class SinkAttention(GroupedQueryAttention):
    """``GroupedQueryAttention`` with biased projections, the per-head ``sinks`` and an optional ``window``."""

    def __init__(self, config: SinkAttentionConfig):
        c = config
        super().__init__(GQAConfig(c.dim, c.n_heads, c.n_kv_heads, c.head_dim))
        for name in ("wq", "wk", "wv", "wo"):
            lin: nn.Linear = getattr(self, name)
            setattr(self, name, nn.Linear(lin.in_features, lin.out_features, bias=True))
        self.window = c.window
        self.sinks = nn.Parameter(torch.empty(c.n_heads))

    def biases(self) -> list[torch.Tensor]:
        return [lin.bias for lin in (self.wq, self.wk, self.wv, self.wo)]

    def tp_plan(self, seq: Shard | Replicate, tp_mesh: DeviceMesh) -> dict[str, ParallelStyle]:
        """Grouped-query attention's plan: column-parallel q/k/v shard their biases with their rows; the
        row-parallel output keeps its bias replicated, which DTensor adds once to the reduced sum. The sinks
        follow the heads (``shard_sinks``, after the plan)."""
        return super().tp_plan(seq, tp_mesh)

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor, *, backend: AttentionBackend,
                documents: DocumentMask | None = None, cache: LayerCache | None = None) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        # -1 instead of n_heads: under tensor parallelism these are the local heads.
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = backend.rotate(xq, xk, rope_cache[..., :seqlen, :])
        q, k, v = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        extras = ScoreExtras(sinks=_local(self.sinks), window=self.window)
        if cache is not None:
            k, v = cache.update(k, v)
            out = backend.attend_cached(q, k, v, cache.mask, extras)
        else:
            if self.training:  # QK-clip: the logits q . k the sinks compete with
                observe(self.max_logits, q, k, documents, self.window)
            out = backend.attend(q, k, v, documents, extras)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))
