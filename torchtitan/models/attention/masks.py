"""Attention masks of the language models: one definition each, and the forms the kernels take.

Two masks (``ModelArgs.attn_mask_type``):

- ``causal``: a token attends to every earlier token of its window (the model's plain
  causal SDPA, untouched by this module);
- ``block_causal`` (the default): a token attends only to earlier tokens of its own
  document. Documents are read from the per-token ``positions`` the data loader yields:
  a position of 0 starts a document (``document_ids``).

One definition, ``document_causal_mask_mod``, says which (query, key) pairs are kept; every form
of the mask is derived from it, so they cannot drift apart: FlexAttention's ``BlockMask`` (CUDA,
built once per forward: ``build_document_mask``), the dense boolean mask (``dense_mask``), and the
rows' document runs (``DocumentMask.segment_lengths``). GPT-OSS's layers limit it to a sliding window
(``sliding_window_mask_mod``; ``layer_mask`` and ``layer_block_mask`` keep each window's form for the
other layers of the forward).

Under context parallelism the mask is built from the *global* positions: each rank
all-gathers the positions of the whole sequence once per forward (``cp_document_mask``),
so a document that crosses a chunk boundary, or starts in one rank's chunk and
continues in another's, is masked exactly as in one process.

The kernels that apply these masks are ``kernels.py``'s; which of them a run uses is the attention
backend's choice (``backends.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.distributed.context_parallel import chunk_ids, gather_sequence

__all__ = [
    "MASK_TYPES",
    "DocumentMask",
    "build_document_mask",
    "causal_mask_mod",
    "check_mask_type",
    "cp_document_mask",
    "dense_mask",
    "document_causal_mask_mod",
    "document_ids",
    "flex_block_mask",
    "layer_block_mask",
    "layer_mask",
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


def flex_block_mask(mask_mod: MaskMod, batch: int, q_len: int, kv_len: int, device: torch.device):  # noqa: ANN201
    """The FlexAttention ``BlockMask`` of ``mask_mod`` (heads broadcast)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(mask_mod, batch, None, q_len, kv_len, device=device)


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
