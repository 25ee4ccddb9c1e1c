"""GPT-OSS attention: grouped-query attention with biases, a learned sink logit per head, and a sliding
window on the layers the config names.

The sink: each head's softmax has one more logit, ``sinks[h]``, whose probability is dropped
after the softmax (Hugging Face's ``eager_attention_forward`` concatenates it), so a query may
put weight on no key at all. The masks are the one definition of ``models/attention.py``:
``document_causal_mask_mod`` (``block_causal``) or ``causal_mask_mod``, limited by
``sliding_window_mask_mod`` on a windowed layer.

Kernels: on CUDA, FlexAttention under the block mask of the mask_mod, its output rescaled by the sink
through the log-sum-exp it returns (``flex_sink_attention``). Elsewhere, and under context parallelism
and in decoding, the scores computed explicitly with the sink column, under the dense mask the
mask_mod gives (``sink_attention``). The mask is evaluated once per forward for
each window the model has and shared by the layers (``layer_mask``, kept on the ``DocumentMask``).
Under context parallelism (``ContextParallelAttention``) keys and values are all-gathered and each of
the rank's two query chunks is masked by the mask_mod shifted to its global offset, as
``cp_block_causal_attention`` does.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan.distributed.context_parallel import chunk_ids, gather_sequence
from torchtitan.models import layers
from torchtitan.models.attention import (
    ContextParallelAttention,
    DocumentMask,
    causal_mask_mod,
    dense_mask,
    document_causal_mask_mod,
    flex_attention_with_lse,
    flex_block_mask,
    sliding_window_mask_mod,
)
from torchtitan.models.kv_cache import LayerCache


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                   sinks: torch.Tensor) -> torch.Tensor:
    """Softmax attention with one extra logit per head: q [B, H, Lq, D]; k, v [B, H_kv, Lk, D];
    ``allowed`` bool [B, 1, Lq, Lk]; ``sinks`` [H] -> [B, H, Lq, D].

    The softmax runs in float32 over the scores and the sink; the sink's share is dropped, so a
    row's weights on the keys sum to less than one.
    """
    n_rep = q.shape[1] // k.shape[1]
    k, v = layers.repeat_kv(k, n_rep), layers.repeat_kv(v, n_rep)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink = sinks.float().view(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


def flex_sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask,  # noqa: ANN001
                        sinks: torch.Tensor) -> torch.Tensor:
    """``sink_attention`` on CUDA: FlexAttention under the layer's ``BlockMask``, its output rescaled by the
    share the keys keep beside the sink, ``sigmoid(lse - sink)`` (the softmax over keys and sink, summed over
    the keys, is ``exp(lse) / (exp(lse) + exp(sink))``)."""
    out, lse = flex_attention_with_lse(q, k, v, block_mask)
    keep = torch.sigmoid(lse.float() - sinks.float().view(1, -1, 1))
    return (out.float() * keep.unsqueeze(-1)).to(out.dtype)


def layer_block_mask(documents: DocumentMask | None, window: int | None, batch: int, seq: int,
                     device: torch.device):  # noqa: ANN201 - a BlockMask
    """``layer_mask`` as FlexAttention's ``BlockMask`` (CUDA), kept on ``documents`` for the other layers."""
    key = ("sink", window, seq)
    if documents is not None and key in documents.block_masks:
        return documents.block_masks[key]
    base = causal_mask_mod() if documents is None else document_causal_mask_mod(documents.docs)
    block_mask = flex_block_mask(base if window is None else sliding_window_mask_mod(base, window), batch, seq, seq,
                                 device)
    if documents is not None:
        documents.block_masks[key] = block_mask
    return block_mask


def layer_mask(documents: DocumentMask | None, window: int | None, batch: int, q_offset: int, q_len: int,
               kv_len: int, device: torch.device) -> torch.Tensor:
    """The dense mask [B, 1, q_len, kv_len] of a layer: block-causal over ``documents`` (None: causal), limited
    to ``window`` (None: full), for queries from ``q_offset``. Kept on ``documents`` for the other layers
    of the forward (one per window and chunk)."""
    key = (window, batch, q_offset, q_len, kv_len)
    if documents is not None and key in documents.dense_masks:
        return documents.dense_masks[key]
    base = causal_mask_mod(q_offset) if documents is None else document_causal_mask_mod(documents.docs, q_offset)
    mod = base if window is None else sliding_window_mask_mod(base, window, q_offset)
    allowed = dense_mask(mod, batch, q_len, kv_len, device)
    if documents is not None:
        documents.dense_masks[key] = allowed
    return allowed


def cp_sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                      documents: DocumentMask | None, window: int | None,
                      backend: ContextParallelAttention) -> torch.Tensor:
    """``sink_attention`` of this CP rank's two load-balanced query chunks against the whole sequence's keys
    (all-gathered; backward: reduce-scattered), each chunk masked at its global offset."""
    mesh = backend.mesh
    chunk = q.shape[2] // 2
    k_all = gather_sequence(k.contiguous(), mesh, dim=2)
    v_all = gather_sequence(v.contiguous(), mesh, dim=2)
    outs = []
    for local, g in enumerate(chunk_ids(mesh.get_local_rank(), mesh.size())):
        offset, n_kv = g * chunk, (g + 1) * chunk
        allowed = layer_mask(documents, window, q.shape[0], offset, chunk, n_kv, q.device)
        outs.append(sink_attention(q[:, :, local * chunk:(local + 1) * chunk], k_all[:, :, :n_kv],
                                   v_all[:, :, :n_kv], allowed, sinks))
    return torch.cat(outs, dim=2)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's heads of a per-head parameter (tensor parallelism shards it with the heads)."""
    return t.to_local() if isinstance(t, DTensor) else t


class SinkAttention(layers.Attention):
    """``layers.Attention`` with biased projections, the per-head ``sinks`` and an optional ``window``.

    The model's attention backend, when set, must be context parallelism's.
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, window: int | None):
        super().__init__(dim, n_heads, n_kv_heads, head_dim, bias=True)
        self.window = window
        self.sinks = nn.Parameter(torch.empty(n_heads))

    def cached_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerCache) -> torch.Tensor:
        """Decoding: the cache's mask (padding, causal) further limited to the window by slot distance."""
        k, v = cache.update(k, v)
        allowed = cache.mask
        if self.window is not None:
            filled, new = k.shape[2], q.shape[2]
            slots = torch.arange(filled - new, filled, device=q.device)
            keys = torch.arange(filled, device=q.device)
            allowed = allowed & (slots[:, None] - keys[None, :] < self.window)
        return sink_attention(q, k, v, allowed, _local(self.sinks))

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor, documents: DocumentMask | None = None,
                cache: LayerCache | None = None) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        # -1 instead of n_heads: under tensor parallelism these are the local heads.
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = self.rotary(xq, xk, rope_cache[..., :seqlen, :])
        q, k, v = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        sinks = _local(self.sinks)
        if cache is not None:
            out = self.cached_attention(q, k, v, cache)
        elif isinstance(self.backend, ContextParallelAttention):
            out = cp_sink_attention(q, k, v, sinks, documents, self.window, self.backend)
        elif self.backend is not None:
            raise NotImplementedError(f"GPT-OSS attention has no kernel for the backend {type(self.backend).__name__}")
        elif q.is_cuda:
            out = flex_sink_attention(q, k, v, layer_block_mask(documents, self.window, bs, seqlen, q.device), sinks)
        else:
            out = sink_attention(q, k, v, layer_mask(documents, self.window, bs, 0, seqlen, seqlen, q.device), sinks)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))

