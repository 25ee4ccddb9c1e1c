"""``DataLayout``: how one rank reads the data, built once and handed to every dataset and loader.

A global batch is ``dp_degree`` local batches of ``local_batch_size`` windows of ``seq_len`` tokens (plus
the one each window's labels look ahead); the rank with data-parallel rank ``dp_rank`` reads rows
``first_row .. first_row + local_batch_size`` of each. Under fault tolerance ``dp_rank``/``dp_degree`` are
the job's data slot (``partition.py``), not the replica group's.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DataLayout:
    """This rank's share of the data: ``local_batch_size`` windows of ``seq_len`` tokens, reader ``dp_rank`` of
    ``dp_degree``. ``ValueError`` on construction when a value cannot work."""

    seq_len: int
    local_batch_size: int
    dp_rank: int = 0
    dp_degree: int = 1

    def __post_init__(self) -> None:
        if self.seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {self.seq_len}")
        if self.local_batch_size <= 0:
            raise ValueError(f"local_batch_size must be positive, got {self.local_batch_size}")
        if self.dp_degree <= 0:
            raise ValueError(f"dp_degree must be positive, got {self.dp_degree}")
        if not 0 <= self.dp_rank < self.dp_degree:
            raise ValueError(f"dp_rank must be in [0, {self.dp_degree}), got {self.dp_rank}")

    @property
    def global_batch_size(self) -> int:
        """Windows in one global batch: every reader's local batch."""
        return self.local_batch_size * self.dp_degree

    @property
    def first_row(self) -> int:
        """This rank's first row within a global batch."""
        return self.dp_rank * self.local_batch_size
