"""The held-out split: which training documents are kept back for validation.

A document is held out when a keyed hash of its text falls below the fraction.
The decision depends on the document's text, the fraction and the seed only, so
every layout, rank, batch size and resumed run holds out the same documents, and
identical copies of a document always land on the same side (no leak through
duplicates). The held-out share is the fraction only on average: each document
is an independent draw.

What a store or a saved data position holds is named by a ``SplitKey``: the
fraction, the seed and the side (the training documents, or the held-out ones).
The key is what is compared, hashed and saved; its sentence (``describe``) is for
messages only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from torchtitan.config.job_config import Validation

__all__ = ["HELD_OUT", "TRAINING", "HeldOutSplit", "SplitKey"]

_SCALE = float(2**64)

Side = Literal["training", "held_out"]
TRAINING: Side = "training"
HELD_OUT: Side = "held_out"


@dataclasses.dataclass(frozen=True)
class SplitKey:
    """One side of one held-out split: the documents a store holds, or a data position counts in."""

    fraction: float
    seed: int
    side: Side

    def to_dict(self) -> dict[str, Any]:
        """The form written to ``index.json`` and to checkpoints."""
        return dataclasses.asdict(self)

    @classmethod
    def parse(cls, saved: dict[str, Any] | str | None) -> SplitKey | None:
        """The key a store index or a checkpoint recorded: a dict, None (nothing held out), or a sentence.

        Stores and checkpoints written before keys existed recorded the split as the
        sentence ``describe`` still writes; it maps onto the same key, so they keep working.
        """
        if saved is None:
            return None
        if isinstance(saved, dict):
            return cls(float(saved["fraction"]), int(saved["seed"]), saved["side"])
        match = _LEGACY_SENTENCE.fullmatch(saved)
        if match is None:
            raise ValueError(f"unrecognised held-out split {saved!r}")
        return cls(float(match["fraction"]), int(match["seed"]), HELD_OUT if match["held_out"] else TRAINING)

    def describe(self) -> str:
        """The split in words, for messages (and, before keys existed, for the records themselves)."""
        text = f"held_out_fraction={self.fraction}, split_seed={self.seed}"
        return f"only the documents held out by {text}" if self.side == HELD_OUT else text


_LEGACY_SENTENCE = re.compile(
    r"(?P<held_out>only the documents held out by )?held_out_fraction=(?P<fraction>[^,]+), split_seed=(?P<seed>\d+)"
)


def describe(key: SplitKey | None) -> str:
    """A key in words; None holds nothing out."""
    return "nothing held out" if key is None else key.describe()


@dataclasses.dataclass(frozen=True)
class HeldOutSplit:
    """Holds out a ``fraction`` of the documents, chosen by a hash keyed with ``seed``."""

    fraction: float  # in (0, 1)
    seed: int = 0

    def __post_init__(self) -> None:
        # Worded for the options: preflight prefixes the section (``--validation.``).
        if not 0.0 < self.fraction < 1.0:
            raise ValueError(f"held_out_fraction={self.fraction}: give a fraction strictly between 0 and 1 (e.g. "
                             "0.01), or leave it unset to hold nothing out")
        if not 0 <= self.seed < 2**64:
            raise ValueError(f"split_seed={self.seed}: give a seed in [0, 2**64)")

    @classmethod
    def from_config(cls, validation: Validation) -> HeldOutSplit | None:
        """The split ``[validation]`` asks for (also while validation is disabled); None holds nothing out."""
        if validation.held_out_fraction is None:
            return None
        return cls(validation.held_out_fraction, validation.split_seed)

    def key(self, side: Side = TRAINING) -> SplitKey:
        return SplitKey(self.fraction, self.seed, side)

    def held_out(self, text: str) -> bool:
        key = self.seed.to_bytes(8, "little")
        digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8, key=key).digest()
        return int.from_bytes(digest, "little") / _SCALE < self.fraction


def side_key(split: HeldOutSplit | None, held_out: bool = False) -> SplitKey | None:
    """The key of the documents a store keeps: all (None), the training side of ``split``, or its held-out side."""
    if split is None:
        return None
    return split.key(HELD_OUT if held_out else TRAINING)
