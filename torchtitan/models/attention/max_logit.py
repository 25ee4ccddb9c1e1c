"""The largest pre-softmax attention logit of each head, measured in the training forward for QK-clip
(``--optimizer.name MuonClip``, torchtitan/optim/qk_clip.py; docs/optimizers.md).

An attention module registers ``max_logits`` as a non-persistent buffer (no part of the state dict), None until
the clip watches it (``watch``: a tensor [heads here] of -inf); its training forward then hands ``observe`` the
queries and keys the backend scores, after the rotation, which keeps each head's running maximum over the step's
forwards in place. A buffer of fixed shape, not a Python object, so a compiled block traces it as one more input
and every block shares one graph. The scores
are recomputed here without gradient, a few query rows at a time, so no ``[B, H, L, L]`` tensor is ever
held, under the same mask as the backend's: causal, the document mask, a sliding window.
"""

from __future__ import annotations

import torch
from torch import nn

from torchtitan.compat import in_pipeline_shape_inference
from torchtitan.models.attention.masks import (
    DocumentMask,
    causal_mask_mod,
    dense_mask,
    document_causal_mask_mod,
    sliding_window_mask_mod,
)


class QKClipped(nn.Module):
    """An attention module QK-clip can take: it measures ``max_logits`` in its training forward (``observe``) and
    says which rows of its weights scale by how much for given per-head factors. The clip (optim/qk_clip.py)
    reaches every family's attention through these queries, never through a family's own class."""

    max_logits: torch.Tensor | None  # the per-head maxima (a non-persistent buffer; None: not watched)

    def clip_heads(self) -> int:
        """The query heads of the whole module (its global weight shapes: the same sharded or not)."""
        raise NotImplementedError

    def clip_refusal(self) -> str | None:
        """Why scaling this module's weights cannot bound its logits (None: it can)."""
        return None

    def clip_row_scales(self, gamma: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, a factor per global row of it) that scale head ``h``'s logits by ``gamma[h]`` exactly, in a
        fixed order; parameters left out stay as they are."""
        raise NotImplementedError


# Scores held at once (float32 elements, 16 MiB): a chunk of query rows against every key.
CHUNK_ELEMENTS = 1 << 22


@torch.no_grad()
def max_logits(q: torch.Tensor, k: torch.Tensor, documents: DocumentMask | None = None,
               window: int | None = None) -> torch.Tensor:
    """Each query head's largest logit ``q . k / sqrt(D)`` over the (query, key) pairs the mask allows -> [H]
    float32.

    ``q`` [B, H, L, D] and ``k`` [B, H_kv, L, D] as the backend gets them (rotated; MLA's queries carry the rest
    of its softmax scale); query head ``h`` reads key head ``h // (H / H_kv)``, as ``repeat_kv``.
    ``documents`` None: causal over the whole window; ``window``: keys at most that many positions back.
    """
    batch, heads, length, dim = q.shape
    kv_heads = k.shape[1]
    grouped = q.float().reshape(batch, kv_heads, heads // kv_heads, length, dim) * dim ** -0.5
    keys_t = k.float().unsqueeze(2).transpose(-1, -2)  # [B, H_kv, 1, D, L]
    rows = max(1, CHUNK_ELEMENTS // (batch * heads * length))
    best = torch.full((kv_heads, heads // kv_heads), float("-inf"), device=q.device)
    for start in range(0, length, rows):
        stop = min(length, start + rows)
        # every mask is causal: the chunk's queries see no key after its last row
        scores = grouped[..., start:stop, :] @ keys_t[..., :stop]  # [B, H_kv, group, rows, stop]
        allowed = dense_mask(_mask_mod(documents, window, start), batch, stop - start, stop, q.device)
        scores.masked_fill_(~allowed.unsqueeze(2), float("-inf"))
        best = torch.maximum(best, scores.amax(dim=(0, 3, 4)))
    return best.flatten()


def _mask_mod(documents: DocumentMask | None, window: int | None, q_offset: int):  # noqa: ANN202 - a MaskMod
    base = causal_mask_mod(q_offset) if documents is None else document_causal_mask_mod(documents.docs, q_offset)
    return base if window is None else sliding_window_mask_mod(base, window, q_offset)


@torch.no_grad()
def observe(maxima: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, documents: DocumentMask | None = None,
            window: int | None = None) -> None:
    """Fold this forward's per-head maxima into ``maxima`` in place: an attention module's ``max_logits`` buffer
    ([heads here], -inf when nothing was measured yet); None: the module is not watched."""
    if maxima is None or in_pipeline_shape_inference():  # a schedule's stand-in tensors learning shapes: not counted
        return
    maxima.copy_(torch.maximum(maxima, max_logits(q, k, documents, window)))


def watch(module: nn.Module, heads: int, device: torch.device) -> None:
    """Give ``module`` (which registered ``max_logits`` as a non-persistent buffer, None until now) its maxima."""
    module.max_logits = torch.full((heads,), float("-inf"), device=device)


def take(module: nn.Module) -> torch.Tensor:
    """The module's maxima [heads here] since the last call (-inf: no forward), and start again."""
    maxima = module.get_buffer("max_logits")
    found = maxima.clone()
    maxima.fill_(float("-inf"))
    return found
