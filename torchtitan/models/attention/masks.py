"""Attention masks of the language models, and the score kernels that apply them.

Two masks (``ModelArgs.attn_mask_type``):

- ``causal``: a token attends to every earlier token of its window (the model's plain
  causal SDPA, untouched by this module);
- ``block_causal`` (the default): a token attends only to earlier tokens of its own
  document. Documents are read from the per-token ``positions`` the data loader yields:
  a position of 0 starts a document (``document_ids``).

One definition, ``document_causal_mask_mod``, says which (query, key) pairs are kept.
Every kernel is derived from it, so they cannot drift apart:

- CUDA: FlexAttention with a ``BlockMask`` built from the mask_mod once per forward
  (``create_block_mask``); no dense S x S mask is ever made.
- CPU, eager: the rows' documents laid end to end and split at the document
  boundaries, one causal SDPA per document (``per_document_sdpa``). Less work survives
  the mask than in a causal window, and the causal kernel keeps its block skipping; a
  dense boolean mask turns that off (benchmarks/README.md, "Document masks").
  The tests check it against the dense mask of the mask_mod.
- CPU under ``torch.compile`` and under context parallelism: SDPA with the dense
  boolean mask that the mask_mod gives (``dense_mask``): traceable, and what CP's
  chunked queries need.

Under context parallelism the mask is built from the *global* positions: each rank
all-gathers the positions of the whole sequence once per forward (``cp_document_mask``),
so a document that crosses a chunk boundary, or starts in one rank's chunk and
continues in another's, is masked exactly as in one process.

Which of these kernels a run uses is the attention backend's choice (``backends.py``); this
module holds the masks and the kernels themselves.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.distributed.context_parallel import attend_chunks, chunk_ids, gather_sequence

__all__ = [
    "MASK_TYPES",
    "DocumentMask",
    "block_causal_attention",
    "build_document_mask",
    "causal_mask_mod",
    "check_mask_type",
    "cp_block_causal_attention",
    "cp_document_mask",
    "dense_mask",
    "document_causal_mask_mod",
    "document_ids",
    "flex_attention_with_lse",
    "flex_block_mask",
    "sliding_window_mask_mod",
]

MASK_TYPES = ("block_causal", "causal")

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def check_mask_type(name: str) -> None:
    if name not in MASK_TYPES:
        raise ValueError(f"attn_mask_type={name!r} is not a mask type; choose one of {', '.join(MASK_TYPES)} "
                         "(--model.attn_mask_type)")


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """[B, L] positions (restarting at 0 at each document's first token) -> [B, L] int32 document numbers.

    Only equality of the numbers matters: they count the document starts up to each token.
    """
    return (positions == 0).cumsum(dim=-1, dtype=torch.int32)


def document_causal_mask_mod(docs: torch.Tensor, q_offset: int = 0) -> MaskMod:
    """The block-causal rule: query ``q_offset + q_idx`` of row ``b`` sees key ``kv_idx`` when it is not
    later and in the same document. ``docs``: [B, L] document numbers of the whole sequence."""

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        q = q_idx + q_offset
        return (q >= kv_idx) & (docs[b, q] == docs[b, kv_idx])

    return mask_mod


def causal_mask_mod(q_offset: int = 0) -> MaskMod:
    """The causal rule across documents (``attn_mask_type=causal``): query ``q_offset + q_idx`` sees every
    key that is not later."""

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return q_idx + q_offset >= kv_idx

    return mask_mod


def sliding_window_mask_mod(mask_mod: MaskMod, window: int, q_offset: int = 0) -> MaskMod:
    """``mask_mod`` (causal or block-causal, shifted by the same ``q_offset``) further limited to the
    ``window`` latest keys, the query's own included: key ``kv`` stays when ``q - kv < window``
    (GPT-OSS's sliding-window layers, as Hugging Face's ``sliding_window_overlay``)."""

    def windowed(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return mask_mod(b, h, q_idx, kv_idx) & (q_idx + q_offset - kv_idx < window)

    return windowed


def dense_mask(mask_mod: MaskMod, batch: int, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """The mask_mod evaluated on every (row, query, key): bool [B, 1, q_len, kv_len] (broadcast over heads)."""
    b = torch.arange(batch, device=device).view(batch, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    q = torch.arange(q_len, device=device).view(1, 1, q_len, 1)
    kv = torch.arange(kv_len, device=device).view(1, 1, 1, kv_len)
    return mask_mod(b, h, q, kv)


class DocumentMask:
    """What every attention layer of one forward shares: the rows' documents, and the kernels' forms of the mask.

    ``docs`` [B, L]: document numbers of the whole sequence (under CP too). ``block_masks``
    (CUDA only): FlexAttention masks keyed by (q_offset, q_len, kv_len), built once per forward.
    ``dense_masks``: dense forms a family's kernel builds on first use and its other layers reuse
    (GPT-OSS: keyed by window, rows, q_offset, q_len, kv_len).
    """

    def __init__(self, docs: torch.Tensor, block_masks: dict | None = None):
        self.docs = docs
        self.block_masks = block_masks or {}
        self.dense_masks: dict[tuple[int | None, int, int, int, int], torch.Tensor] = {}
        self._segments: list[int] | None = None

    def segment_lengths(self) -> list[int]:
        """Lengths of the (row, document) runs of the rows laid end to end; computed once (one host sync)."""
        if self._segments is None:
            flat = self.docs.reshape(-1)
            starts = torch.ones_like(flat, dtype=torch.bool)
            starts[1:] = flat[1:] != flat[:-1]
            starts.view(self.docs.shape)[:, 0] = True  # a row never continues the previous row
            bounds = torch.cat([starts.nonzero().flatten(), flat.new_tensor([flat.numel()], dtype=torch.long)])
            self._segments = bounds.diff().tolist()
        return self._segments


def _flex_block_mask(docs: torch.Tensor, q_offset: int, q_len: int, kv_len: int):
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(document_causal_mask_mod(docs, q_offset), docs.shape[0], None, q_len, kv_len,
                             device=docs.device)


def _as_rows(positions: torch.Tensor, batch: int | None) -> torch.Tensor:
    return positions.unsqueeze(0).expand(batch or 1, -1) if positions.dim() == 1 else positions


def build_document_mask(positions: torch.Tensor, batch: int | None = None) -> DocumentMask:
    """The mask of one forward from its [B, L] (or [L]) positions, on their device."""
    docs = document_ids(_as_rows(positions, batch))
    mask = DocumentMask(docs)
    if docs.is_cuda:
        seq = docs.shape[1]
        mask.block_masks[(0, seq, seq)] = _flex_block_mask(docs, 0, seq, seq)
    return mask


def cp_document_mask(positions: torch.Tensor, batch: int | None = None, *, mesh: DeviceMesh) -> DocumentMask:
    """``build_document_mask`` for this CP rank's load-balanced chunks: the positions of the whole sequence
    are all-gathered (once per forward), so documents crossing chunk boundaries are masked globally."""
    rows = _as_rows(positions, batch).contiguous()
    whole = gather_sequence(rows, mesh, dim=1)
    docs = document_ids(whole)
    mask = DocumentMask(docs)
    if docs.is_cuda:
        cp_size, cp_rank = mesh.size(), mesh.get_local_rank()
        chunk = rows.shape[1] // 2
        for g in chunk_ids(cp_rank, cp_size):
            key = (g * chunk, chunk, (g + 1) * chunk)
            mask.block_masks[key] = _flex_block_mask(docs, *key)
    return mask


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


def flex_block_mask(mask_mod: MaskMod, batch: int, q_len: int, kv_len: int, device: torch.device):  # noqa: ANN201
    """The FlexAttention ``BlockMask`` of ``mask_mod`` (heads broadcast)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(mask_mod, batch, None, q_len, kv_len, device=device)


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
