"""Grouped-query attention with rotary positions, optionally with per-head query/key norms: the attention
module of Llama 3 (no norm), Qwen3 (norm) and Mixtral (no norm).

A block is given its attention module (``GQAConfig.build``); the module owns the projections and the
optional norms, and hands rotation and scores to the backend the decoder passes in (``backends.py``).
Another attention (MLA, sinks with sliding windows) is another config with its own module, built by
the block the same way, and states its ``AttentionNeeds`` for preflight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from torchtitan.models.attention.backends import AttentionBackend, AttentionNeeds
from torchtitan.models.attention.masks import DocumentMask
from torchtitan.models.attention.max_logit import QKClipped, observe
from torchtitan.models.kv_cache import LayerCache, LayerCacheSize
from torchtitan.models.layers import RMSNorm


@dataclass(frozen=True)
class GQAConfig:
    """Grouped-query attention: ``n_heads`` query heads share ``n_kv_heads`` key/value heads of ``head_dim``.

    ``qk_norm_eps``: Qwen3's query/key norm, an RMSNorm over each head's ``head_dim`` applied to q and k
    before the rotation (None: none, as Llama 3 and Mixtral). ``head_dim`` need not be ``dim / n_heads``.
    """

    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    qk_norm_eps: float | None = None

    def build(self) -> GroupedQueryAttention:
        return GroupedQueryAttention(self)

    def needs(self, mask_type: str) -> AttentionNeeds:
        return AttentionNeeds(mask=mask_type)

    def num_params(self) -> int:
        """Projections and norms of one layer."""
        proj = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        return proj + (2 * self.head_dim if self.qk_norm_eps is not None else 0)

    def tp_widths(self) -> list[tuple[str, int]]:
        """The widths tensor parallelism splits (preflight: each must divide by the TP degree)."""
        return [("n_heads", self.n_heads), ("n_kv_heads", self.n_kv_heads)]

    def cache_size(self) -> LayerCacheSize:
        """A key and a value of ``head_dim`` per key/value head and token."""
        keys_and_values = 2 * self.n_kv_heads * self.head_dim
        return LayerCacheSize(held=keys_and_values, expanded=keys_and_values)

    def qk_clip_refusal(self) -> str | None:
        if self.qk_norm_eps is not None:
            return ("its attention normalizes each head's queries and keys (QK-norm), so scaling the query weights "
                    "does not reach the logit")
        return None


class GroupedQueryAttention(QKClipped):
    """``wq, wk, wv`` -> (query/key norms) -> rotation -> the backend's scores -> ``wo``."""

    def __init__(self, config: GQAConfig):
        super().__init__()
        c = config
        self.head_dim = c.head_dim
        self.wq = nn.Linear(c.dim, c.n_heads * c.head_dim, bias=False)
        self.wk = nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=False)
        self.wv = nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=False)
        self.wo = nn.Linear(c.n_heads * c.head_dim, c.dim, bias=False)
        self.q_norm: RMSNorm | None = None if c.qk_norm_eps is None else RMSNorm(c.head_dim, c.qk_norm_eps)
        self.k_norm: RMSNorm | None = None if c.qk_norm_eps is None else RMSNorm(c.head_dim, c.qk_norm_eps)
        self.register_buffer("max_logits", None, persistent=False)  # QK-clip's measurement (attention/max_logit.py)

    def clip_heads(self) -> int:
        return self.wq.weight.shape[0] // self.head_dim

    def clip_refusal(self) -> str | None:
        if self.q_norm is not None:
            return ("it normalizes each head's queries and keys (QK-norm), so scaling wq cannot reach the logit")
        return None

    def clip_row_scales(self, gamma: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Head ``h``'s query rows (and their bias) by ``gamma_h``, the keys untouched.

        Why the queries alone: a key head is shared by its query group, so scaling a key would move the logits of
        every head of the group, those under the threshold too. Scaling head ``h``'s query rows scales its logits
        by exactly ``gamma_h`` and leaves every other head's weights bitwise as they are (a factor of 1 is exact).
        """
        rows = gamma.repeat_interleave(self.head_dim)
        scaled = [(self.wq.weight, rows)]
        if self.wq.bias is not None:  # a biased query (GPT-OSS) scales with its rows
            scaled.append((self.wq.bias, rows))
        return scaled

    def in_projections(self) -> list[nn.Linear]:
        """The projections into the heads (init and TP treat them alike)."""
        return [self.wq, self.wk, self.wv]

    def out_projections(self) -> list[nn.Linear]:
        return [self.wo]

    def tp_plan(self, seq: Shard | Replicate, tp_mesh: DeviceMesh) -> dict[str, ParallelStyle]:
        """This module's TP plan (names relative to it; "" is the module): column-parallel in-projections,
        a row-parallel out-projection whose output takes the residual stream's layout ``seq``. Query/key
        norms act on this rank's heads: their weight becomes a replicated DTensor whose input is sharded on
        the head dim, so its gradient (a sum over all heads) is reduced over TP."""
        plan: dict[str, ParallelStyle] = {
            "wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(),
            "wo": RowwiseParallel(output_layouts=seq),
            "": PrepareModuleInput(input_layouts=(seq, None), desired_input_layouts=(Replicate(), None)),
        }
        if self.q_norm is not None:
            plan.update({"q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
                         "k_norm": SequenceParallel(sequence_dim=2, use_local_output=True)})
        return plan

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor, *, backend: AttentionBackend,
                documents: DocumentMask | None = None, cache: LayerCache | None = None) -> torch.Tensor:
        """``backend``: the decoder's (rotation and scores); ``cache``: decoding (models/kv_cache.py) appends
        this forward's keys and values to it and attends to all it holds (``backend.attend_cached``)."""
        bs, seqlen, _ = x.shape
        # -1 instead of n_heads: under tensor parallelism these are the local heads.
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # per head, before the rotation (Qwen3): both or none
            xq, xk = self.q_norm(xq), self.k_norm(xk)
        xq, xk = backend.rotate(xq, xk, rope_cache[..., :seqlen, :])
        q, k, v = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v)
            out = backend.attend_cached(q, k, v, cache.mask)
        else:
            if self.training:
                observe(self.max_logits, q, k, documents)
            out = backend.attend(q, k, v, documents)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))
