"""Score kernels for attention with a learned sink logit per head and an optional sliding window
(GPT-OSS): what the backends (``backends.py``) run when a call's ``ScoreExtras`` asks for either.

The sink: each head's softmax has one more logit, ``sinks[h]``, whose probability is dropped after the
softmax (Hugging Face's ``eager_attention_forward`` concatenates it), so a query may put weight on no key
at all. The masks are the one definition of ``masks.py``: ``document_causal_mask_mod`` (documents) or
``causal_mask_mod``, limited by ``sliding_window_mask_mod`` when a window is given.

Kernels: on CUDA, FlexAttention under the block mask of the mask_mod, its output rescaled by the sink
through the log-sum-exp it returns (``flex_sink_attention``). Elsewhere, under context parallelism and in
decoding, the scores computed explicitly with the sink column under the dense mask the mask_mod gives
(``sink_attention``). A mask is evaluated once per forward for each window and kept on the
``DocumentMask`` for the other layers.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.distributed.context_parallel import chunk_ids, gather_sequence
from torchtitan.models.attention.masks import (
    DocumentMask,
    causal_mask_mod,
    dense_mask,
    document_causal_mask_mod,
    flex_attention_with_lse,
    flex_block_mask,
    sliding_window_mask_mod,
)
from torchtitan.models.layers import repeat_kv


def _no_sinks(q: torch.Tensor) -> torch.Tensor:
    """A sink logit of -inf per head: plain softmax attention through the same kernel (a window alone)."""
    return torch.full((q.shape[1],), float("-inf"), device=q.device)


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                   sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax attention with one extra logit per head: q [B, H, Lq, D]; k [B, H_kv, Lk, D]; v [B, H_kv, Lk, D_v];
    ``allowed`` bool [B, 1, Lq, Lk]; ``sinks`` [H] (None: none) -> [B, H, Lq, D_v].

    The softmax runs in float32 over the scores and the sink; the sink's share is dropped, so a row's
    weights on the keys sum to less than one.
    """
    sinks = _no_sinks(q) if sinks is None else sinks
    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink = sinks.float().view(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


def flex_sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask,  # noqa: ANN001
                        sinks: torch.Tensor | None) -> torch.Tensor:
    """``sink_attention`` on CUDA: FlexAttention under the layer's ``BlockMask``, its output rescaled by the
    share the keys keep beside the sink, ``sigmoid(lse - sink)`` (the softmax over keys and sink, summed over
    the keys, is ``exp(lse) / (exp(lse) + exp(sink))``)."""
    out, lse = flex_attention_with_lse(q, k, v, block_mask)
    if sinks is None:
        return out
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
    """The dense mask [B, 1, q_len, kv_len]: block-causal over ``documents`` (None: causal), limited to ``window``
    (None: full), for queries from ``q_offset``. Kept on ``documents`` for the other layers of the forward."""
    key = (window, batch, q_offset, q_len, kv_len)
    if documents is not None and key in documents.dense_masks:
        return documents.dense_masks[key]
    base = causal_mask_mod(q_offset) if documents is None else document_causal_mask_mod(documents.docs, q_offset)
    mod = base if window is None else sliding_window_mask_mod(base, window, q_offset)
    allowed = dense_mask(mod, batch, q_len, kv_len, device)
    if documents is not None:
        documents.dense_masks[key] = allowed
    return allowed


def local_sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: DocumentMask | None,
                         sinks: torch.Tensor | None, window: int | None) -> torch.Tensor:
    """Whole sequences on one rank: FlexAttention on CUDA, the explicit kernel elsewhere."""
    bs, seq = q.shape[0], q.shape[2]
    if q.is_cuda:
        return flex_sink_attention(q, k, v, layer_block_mask(documents, window, bs, seq, q.device), sinks)
    return sink_attention(q, k, v, layer_mask(documents, window, bs, 0, seq, seq, q.device), sinks)


def cp_sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: DocumentMask | None,
                      sinks: torch.Tensor | None, window: int | None, mesh: DeviceMesh) -> torch.Tensor:
    """``sink_attention`` of this CP rank's two load-balanced query chunks against the whole sequence's keys
    (all-gathered; backward: reduce-scattered), each chunk masked at its global offset."""
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


def cached_sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                          sinks: torch.Tensor | None, window: int | None) -> torch.Tensor:
    """Decoding: the new tokens' queries against every cached key and value (this step's the last), under the
    cache's ``mask`` (padding, causal) further limited to the window by slot distance."""
    allowed = mask
    if window is not None:
        filled, new = k.shape[2], q.shape[2]
        slots = torch.arange(filled - new, filled, device=q.device)
        keys = torch.arange(filled, device=q.device)
        allowed = allowed & (slots[:, None] - keys[None, :] < window)
    return sink_attention(q, k, v, allowed, sinks)
