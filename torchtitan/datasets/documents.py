"""Per-token positions within documents, derived from the BOS tokens the packing puts at each document's start.

Every document enters the token stream as BOS + text + EOS (``prepare.py``, ``stream_dataset.py``),
so a window's document boundaries are its BOS tokens; stores prepared before positions existed
hold them too, and need no new preparation. A window's first token counts as a start as well:
a document continued from the previous window restarts at 0 there. Attention only sees
differences of positions within one document, so this changes nothing but keeps every
position below the window length (the rotary cache's size).

Positions depend on the window's tokens alone: deterministic, the same in every layout, and
exact on resume.
"""

from __future__ import annotations

import torch

__all__ = ["document_positions"]


def document_positions(tokens: torch.Tensor, bos_id: int) -> torch.Tensor:
    """[..., L] token ids -> [..., L] int64 positions: 0 at each BOS and at the first token, then counting up."""
    index = torch.arange(tokens.shape[-1], dtype=torch.int64).expand(tokens.shape)
    starts = (tokens == bos_id)
    starts[..., 0] = True
    last_start = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - last_start
