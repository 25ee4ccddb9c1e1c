"""The held-out split: which training documents are kept back for validation.

A document is held out when a keyed hash of its text falls below the fraction.
The decision depends on the document's text, the fraction and the seed only, so
every layout, rank, batch size and resumed run holds out the same documents, and
identical copies of a document always land on the same side (no leak through
duplicates). The held-out share is the fraction only on average: each document
is an independent draw.
"""

from __future__ import annotations

import dataclasses
import hashlib

_SCALE = float(2**64)


@dataclasses.dataclass(frozen=True)
class HeldOutSplit:
    fraction: float  # in (0, 1)
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 < self.fraction < 1.0:
            raise ValueError(f"held-out fraction must be in (0, 1), got {self.fraction}")
        if not 0 <= self.seed < 2**64:
            raise ValueError(f"split seed must be in [0, 2**64), got {self.seed}")

    def held_out(self, text: str) -> bool:
        key = self.seed.to_bytes(8, "little")
        digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8, key=key).digest()
        return int.from_bytes(digest, "little") / _SCALE < self.fraction

    def training_filter(self):
        """Predicate keeping the documents training may see."""
        return lambda text: not self.held_out(text)

    def validation_filter(self):
        """Predicate keeping the held-out documents."""
        return self.held_out
