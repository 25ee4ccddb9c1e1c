"""The score kernels of attention: what the backends (``backends.py``) run, each applying a mask of ``masks.py``.

Document masks (``block_causal``), every kernel derived from the one ``document_causal_mask_mod``:

- CUDA: FlexAttention with the forward's ``BlockMask`` (``block_causal_attention``); no dense S x S mask.
- CPU, eager: the rows' documents laid end to end and split at the document boundaries, one causal SDPA
  per document (``per_document_sdpa``). Less work survives the mask than in a causal window, and the
  causal kernel keeps its block skipping; a dense boolean mask turns that off (benchmarks/README.md,
  "Document masks").
- CPU under ``torch.compile`` and under context parallelism: SDPA with the dense boolean mask
  (``dense_mask``): traceable, and what CP's chunked queries need (``cp_block_causal_attention``).

A learned sink logit per head and an optional sliding window (GPT-OSS): each head's softmax has one more
logit, ``sinks[h]``, whose probability is dropped after the softmax (Hugging Face's
``eager_attention_forward`` concatenates it), so a query may put weight on no key at all. On CUDA,
FlexAttention under the layer's block mask, its output rescaled by the sink through the log-sum-exp it
returns (``flex_sink_attention``); elsewhere, under context parallelism and in decoding, the scores
computed explicitly with the sink column under the dense mask (``sink_attention``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.distributed.context_parallel import attend_chunks, chunk_ids, gather_sequence
from torchtitan.models.attention.masks import (
    DocumentMask,
    dense_mask,
    document_causal_mask_mod,
    layer_block_mask,
    layer_mask,
)
from torchtitan.models.layers import repeat_kv

__all__ = [
    "block_causal_attention",
    "cached_sink_attention",
    "cp_block_causal_attention",
    "cp_sink_attention",
    "flex_attention_with_lse",
    "flex_sink_attention",
    "local_sink_attention",
    "per_document_sdpa",
    "rescale_by_sinks",
    "sink_attention",
]


@functools.lru_cache(maxsize=1)
def _compiled_flex() -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    # Inside a compiled block dynamo lowers flex_attention itself; eager needs the compiled wrapper
    # (the uncompiled one materializes the scores).
    fn = flex_attention if torch.compiler.is_compiling() else _compiled_flex()
    return fn(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])


def flex_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            block_mask) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001 - a BlockMask
    """FlexAttention's output [B, H, L, D] and log-sum-exp of the scores [B, H, L] (float32), both differentiable:
    what a kernel that rescales the output afterwards needs (GPT-OSS's sinks)."""
    from torch.nn.attention.flex_attention import flex_attention

    fn = flex_attention if torch.compiler.is_compiling() else _compiled_flex()
    return fn(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1], return_lse=True)


def _runs(segments: list[int], seq: int) -> list[tuple[int, int]]:
    """(rows, length) pieces: consecutive one-document rows merge into one batched piece."""
    runs: list[tuple[int, int]] = []
    for n in segments:
        if n == seq and runs and runs[-1][1] == seq:
            runs[-1] = (runs[-1][0] + 1, seq)
        else:
            runs.append((1, n))
    return runs


def per_document_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: list[int]) -> torch.Tensor:
    """One causal SDPA per document: q, k [B, H(_kv), L, D], v [B, H_kv, L, Dv] -> [B, H, L, Dv].

    The rows are laid end to end as [B*L, heads, D] (free when the tensors are head-transposed
    views of [B, L, heads, D], as in the model) and cut with one ``split``, so backward gathers
    the pieces' gradients with one concatenation instead of a full-size buffer per piece.
    Consecutive rows that hold one document each go through one batched call.
    """
    batch, heads, seq, _ = q.shape
    runs = _runs(segments, seq)
    sizes = [rows * length for rows, length in runs]

    def pieces(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return t.transpose(1, 2).reshape(batch * seq, t.shape[1], t.shape[-1]).split(sizes)

    gqa = heads != k.shape[1]
    v_dim = v.shape[-1]  # may differ from the query/key head (MLA)
    outs = []
    for (rows, length), a, b, c in zip(runs, pieces(q), pieces(k), pieces(v)):
        a, b, c = (t.reshape(rows, length, t.shape[1], t.shape[-1]).transpose(1, 2) for t in (a, b, c))
        out = F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=gqa)
        outs.append(out.transpose(1, 2).reshape(rows * length, heads, v_dim))
    return torch.cat(outs).view(batch, seq, heads, v_dim).transpose(1, 2)


def _dense_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def block_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocumentMask) -> torch.Tensor:
    """Document-masked attention of whole sequences: q [B, H, L, D]; k, v [B, H_kv, L, D] (grouped-query)."""
    seq = q.shape[2]
    if q.is_cuda:
        return _flex(q, k, v, mask.block_masks[(0, seq, seq)])
    if torch.compiler.is_compiling():
        return _dense_sdpa(q, k, v, dense_mask(document_causal_mask_mod(mask.docs), q.shape[0], seq, seq, q.device))
    return per_document_sdpa(q, k, v, mask.segment_lengths())


def cp_block_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocumentMask,
                              mesh: DeviceMesh) -> torch.Tensor:
    """``block_causal_attention`` of this CP rank's two load-balanced chunks against the whole sequence's keys.

    Keys and values are all-gathered (backward: reduce-scatter), as for causal CP; each local
    query chunk ``g`` attends to the keys up to its own end (``attend_chunks``, the one CP loop),
    under the mask_mod shifted by the chunk's global offset.
    """
    k_all = gather_sequence(k.contiguous(), mesh, dim=2)
    v_all = gather_sequence(v.contiguous(), mesh, dim=2)

    def score(q_chunk: torch.Tensor, g: int, k_g: torch.Tensor, v_g: torch.Tensor) -> torch.Tensor:
        chunk, n_kv = q_chunk.shape[2], k_g.shape[2]
        offset = g * chunk
        if q_chunk.is_cuda:
            return _flex(q_chunk, k_g, v_g, mask.block_masks[(offset, chunk, n_kv)])
        allowed = dense_mask(document_causal_mask_mod(mask.docs, offset), q.shape[0], chunk, n_kv, q.device)
        return _dense_sdpa(q_chunk, k_g, v_g, allowed)

    return attend_chunks(q, k_all, v_all, mesh, score)


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
    return rescale_by_sinks(*flex_attention_with_lse(q, k, v, block_mask), sinks)


def rescale_by_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """An attention output [B, H, L, D_v] times the share of each row's softmax that its keys keep beside the
    sink, from the scores' log-sum-exp [B, H, L] (``flex_sink_attention``; the planner's stand-in for it too)."""
    if sinks is None:
        return out
    keep = torch.sigmoid(lse.float() - sinks.float().view(1, -1, 1))
    return (out.float() * keep.unsqueeze(-1)).to(out.dtype)


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
