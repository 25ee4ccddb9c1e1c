"""Requests as token rows: one row per (request, choice), scored only on the choice's tokens.

The tokenization boundary. A choice is scored as the tokens it takes *in running text after
the context*, not as the tokens of the choice alone: ``enc(context + choice)`` is split where
it stops agreeing with ``enc(context)``. Encoding the choice alone would differ: SentencePiece
adds a dummy-prefix space to every text it encodes, and BPE merges differ at a text's start.
Whitespace that ends the context moves to the choice first (``"Q: "``, ``"A"`` is scored as
``"Q:"``, ``" A"``), since tokenizers attach a space to the word after it. The choice's
characters and bytes (for ``acc_norm`` and ``bpb``) are those of the text scored.

A row is ``[BOS] + context + choice``: inputs all but its last token, labels its next tokens,
``IGNORE_INDEX`` except on the choice. A row longer than ``seq_len + 1`` loses context tokens
from the left (after BOS); a choice of more than ``seq_len`` tokens cannot be scored and is
refused (``check_lengths``). Rows are padded to ``seq_len`` (labels ignored), so every batch
has training's shape (CP shards it, PP sends it) whatever the requests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from torchtitan.datasets.tokenizer import Tokenizer
from torchtitan.downstream.request import Request, TaskError
from torchtitan.loss import IGNORE_INDEX


@dataclasses.dataclass(frozen=True)
class ScoredChoice:
    """One row before padding: context ids (after BOS) and the choice's ids, and the choice text they score."""

    context_ids: tuple[int, ...]
    choice_ids: tuple[int, ...]
    text: str  # the choice as scored (with the whitespace moved from the context)


def split_pair(tokenizer: Tokenizer, context: str, choice: str) -> ScoredChoice:
    """The context's and the choice's tokens of ``context + choice`` encoded as one text (see the module docstring)."""
    stripped = context.rstrip()
    if stripped != context:
        choice = context[len(stripped):] + choice
        context = stripped
    whole = tokenizer.encode(context + choice, bos=False, eos=False)
    alone = tokenizer.encode(context, bos=False, eos=False) if context else []
    shared = 0
    while shared < min(len(whole), len(alone)) and whole[shared] == alone[shared]:
        shared += 1
    return ScoredChoice(tuple(whole[:shared]), tuple(whole[shared:]), choice)


def request_rows(tokenizer: Tokenizer, request: Request) -> list[ScoredChoice]:
    return [split_pair(tokenizer, request.context, choice) for choice in request.choices]


def check_lengths(task_name: str, rows: Sequence[ScoredChoice], choice_of: Sequence[tuple[int, int]],
                  seq_len: int) -> None:
    """``TaskError`` for a choice that has no tokens or more than ``seq_len`` (nothing to score, or no room);
    ``choice_of[i]`` is row ``i``'s (request, choice)."""
    for row, (number, index) in zip(rows, choice_of):
        if not row.choice_ids:
            raise TaskError(f"eval task {task_name!r} request {number} choice {index}: no tokens of its own after "
                            "the context (it merges into the context's last token); give choices that add text")
        if len(row.choice_ids) > seq_len:
            raise TaskError(f"eval task {task_name!r} request {number} choice {index}: {len(row.choice_ids)} "
                            f"tokens, more than --training.seq_len={seq_len}; shorten the choice or raise seq_len")


def row_tensors(row: ScoredChoice | None, bos_id: int, pad_id: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, labels)`` of one row, ``seq_len`` long; None gives a padding row (nothing scored)."""
    inputs = torch.full((seq_len,), pad_id, dtype=torch.long)
    labels = torch.full((seq_len,), IGNORE_INDEX, dtype=torch.long)
    if row is None:
        return inputs, labels
    room = seq_len + 1 - 1 - len(row.choice_ids)  # tokens left for the context after BOS
    context = row.context_ids[max(0, len(row.context_ids) - room):] if room > 0 else ()
    tokens = [bos_id, *context, *row.choice_ids]
    n = len(tokens) - 1
    inputs[:n] = torch.tensor(tokens[:-1])
    labels[n - len(row.choice_ids):n] = torch.tensor(row.choice_ids)
    return inputs, labels
