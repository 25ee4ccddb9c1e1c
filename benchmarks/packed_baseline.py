"""The loader every rank ran before the token store: the baseline of ``benchmarks/data.py``.

Each DP rank streams and tokenizes *all* documents, cuts the one global token stream
into ``seq_len + 1`` windows and keeps its own block of each global batch, so its cost
per step grows with the DP degree; a resume re-reads and re-tokenizes everything before
the saved window. The token store (``torchtitan/datasets/token_store.py``) replaced it
in training and validation; it lives on here only so that the benchmark can measure
what the store saves. Same windows, same dealing, same (epoch, window) position.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset

from torchtitan.datasets.tokenizer import Tokenizer


class EveryRankPacks(IterableDataset):
    """Yields this DP rank's ``(inputs, labels)`` samples, each ``[seq_len]``, from the global stream."""

    def __init__(self, *, source: Iterable[dict[str, Any]], text_field: str, tokenizer: Tokenizer, seq_len: int,
                 local_batch_size: int, dp_rank: int, dp_degree: int) -> None:
        self.source, self.text_field, self.tokenizer = source, text_field, tokenizer
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        self._epoch = 0
        self._next_window = 0  # first window of the next global batch this rank has not finished

    def _windows(self) -> Iterator[list[int]]:
        width, buffer = self.seq_len + 1, []
        for record in self.source:
            text = record[self.text_field]
            if not text:
                continue
            buffer.extend(self.tokenizer.encode(text, bos=True, eos=True))
            start = 0
            while len(buffer) - start >= width:
                yield buffer[start : start + width]
                start += width
            del buffer[:start]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        local, global_batch = self.local_batch_size, self.local_batch_size * self.dp_degree
        mine = range(self.dp_rank * local, (self.dp_rank + 1) * local)
        while True:
            base, pending = self._next_window, []
            for index, window in enumerate(self._windows()):
                if index < base:
                    continue  # consumed before the position we resumed from: read and tokenized all the same
                batch_index, offset = divmod(index - base, global_batch)
                if offset in mine:
                    tokens = torch.tensor(window, dtype=torch.long)
                    pending.append((tokens[:-1], tokens[1:]))
                if offset == global_batch - 1:
                    self._next_window = base + (batch_index + 1) * global_batch
                    yield from pending
                    pending = []
            self._epoch, self._next_window = self._epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "next_window": self._next_window}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._epoch, self._next_window = int(state_dict["epoch"]), int(state_dict["next_window"])


def collate_pairs(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])
