"""Token store: a corpus tokenized once into memory-mapped shards, read by window index (read-only here).

Layout of a store folder
------------------------
``index.json``
    Format version, token dtype, vocabulary size, fingerprints of the tokenizer
    and of the source, the key of the held-out split side the store holds
    (``split.SplitKey``; None when it holds every document), and one entry per
    shard (file name, tokens, documents).
``shard_00000.bin`` ...
    The token ids of consecutive documents, each framed by BOS and EOS, as a
    raw little-endian array (``uint16`` when the vocabulary fits, else ``uint32``).
``shard_00000.docs.npy`` ...
    The end offset of every document inside the shard (document boundaries).

The shards concatenated are one token stream, so global window ``i`` is the
``seq_len + 1`` tokens starting at token ``i * (seq_len + 1)``: any window is
read in constant time, and a rank reads (memory-maps and touches) only its own
windows. How a store is written (atomically, resumably): ``prepare.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan.datasets.sources import TokenStoreError, tokenizer_fingerprint
from torchtitan.datasets.split import HELD_OUT, HeldOutSplit, SplitKey, describe, side_key

__all__ = ["FORMAT", "INDEX_NAME", "PLAN_NAME", "VERSION", "TokenStore", "is_store", "looks_like_store"]

FORMAT = "torchtitan-token-store"
VERSION = 1
INDEX_NAME = "index.json"
PLAN_NAME = "plan.json"  # present while a preparation is under way (see prepare.py)


def is_store(path: str | os.PathLike) -> bool:
    return (Path(path) / INDEX_NAME).is_file()


def looks_like_store(path: Path) -> bool:
    """A folder of store files (shards, or a preparation marker) -- with or without its index."""
    return path.is_dir() and (any(path.glob("shard_*.bin")) or (path / PLAN_NAME).exists())


class TokenStore:
    """Read-only view of a prepared store; shards are memory-mapped on first use."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.index = self._read_index()
        try:
            # Stores prepared before split keys existed recorded a sentence; ``parse`` maps it to the same key.
            self.split_key = SplitKey.parse(self.index.get("split"))
        except (ValueError, KeyError, TypeError) as e:
            raise TokenStoreError(f"{self.path / INDEX_NAME}: {e}; prepare the store again") from None
        self.dtype = np.dtype(self.index["dtype"])
        self.shard_files = [self.path / s["file"] for s in self.index["shards"]]
        sizes = [int(s["tokens"]) for s in self.index["shards"]]
        self._check_shards(sizes)
        self.starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self.n_tokens = int(self.starts[-1])
        self._maps: dict[int, np.ndarray] = {}

    def _read_index(self) -> dict[str, Any]:
        index_file = self.path / INDEX_NAME
        if not index_file.is_file():
            raise TokenStoreError(
                f"token store {self.path} has no {INDEX_NAME}: it is not a finished store (an interrupted "
                "preparation?); rerun scripts/prepare_data.py for it, or point dataset_path at the source files"
            )
        try:
            index = json.loads(index_file.read_text())
        except ValueError as e:
            raise TokenStoreError(f"{index_file}: unreadable index ({e}); prepare the store again") from None
        if index.get("format") != FORMAT or index.get("version") != VERSION:
            raise TokenStoreError(
                f"{index_file}: format {index.get('format')!r} version {index.get('version')!r}, this code reads "
                f"{FORMAT!r} version {VERSION}; prepare the store again"
            )
        return index

    def _check_shards(self, sizes: list[int]) -> None:
        for file, tokens in zip(self.shard_files, sizes):
            try:
                actual = file.stat().st_size
            except FileNotFoundError:
                raise TokenStoreError(
                    f"token store {self.path}: shard {file} is missing; prepare the store again") from None
            if actual != tokens * self.dtype.itemsize:
                raise TokenStoreError(
                    f"token store {self.path}: shard {file} has {actual} bytes, the index says "
                    f"{tokens * self.dtype.itemsize} (truncated or replaced); prepare the store again"
                )

    def check_tokenizer(self, tokenizer_path: str, vocab_size: int) -> None:
        theirs = self.index["tokenizer"]
        if theirs["sha256"] != tokenizer_fingerprint(tokenizer_path) or self.index["vocab_size"] != vocab_size:
            raise TokenStoreError(
                f"token store {self.path} was prepared with the tokenizer {theirs['path']} (sha256 "
                f"{theirs['sha256'][:12]}), but this run uses {tokenizer_path}: its token ids would be wrong; "
                "prepare the store with this run's tokenizer (scripts/prepare_data.py --tokenizer ...)"
            )

    def check_split(self, split: HeldOutSplit | None) -> None:
        """A training store holds exactly the documents the run's split leaves to training."""
        mine = side_key(split)
        if self.split_key != mine:
            raise TokenStoreError(
                f"token store {self.path} was prepared with {describe(self.split_key)}, "
                f"but this run holds out {mine.describe() if mine else 'nothing'}: held-out documents would reach "
                "training (or training data would go missing); prepare it with the run's "
                "--validation.held_out_fraction and --validation.split_seed"
            )

    def check_held_out_side(self, split: HeldOutSplit | None) -> None:
        """A store of held-out documents validates only the run that holds out those documents."""
        theirs = self.split_key
        if theirs is not None and theirs.side == HELD_OUT and theirs != side_key(split, held_out=True):
            mine = side_key(split)
            raise TokenStoreError(
                f"token store {self.path} holds {theirs.describe()}, but this run holds out "
                f"{mine.describe() if mine else 'nothing'}: training would see some of the validation documents; "
                "give the run that split (or prepare the held-out side of the run's split)"
            )

    def check_fits(self, seq_len: int, global_batch: int) -> None:
        """At least one global batch of windows: every rank reads a whole one, or none does."""
        windows = self.n_tokens // (seq_len + 1)
        if windows < global_batch:
            raise TokenStoreError(
                f"token store {self.path} holds {windows} window(s) of {seq_len + 1} tokens ({self.n_tokens:,} "
                f"tokens), fewer than one global batch ({global_batch} windows); use more data or a smaller "
                "seq_len or batch size"
            )

    def _shard(self, number: int) -> np.ndarray:
        shard = self._maps.get(number)
        if shard is None:
            if self.starts[number + 1] == self.starts[number]:
                shard = np.empty(0, dtype=self.dtype)
            else:
                shard = np.memmap(self.shard_files[number], dtype=self.dtype, mode="r")
            self._maps[number] = shard
        return shard

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` of the concatenated shards, as int64."""
        out = np.empty(length, dtype=np.int64)
        number = int(np.searchsorted(self.starts, start, side="right")) - 1
        filled = 0
        while filled < length:
            offset = start + filled - int(self.starts[number])
            piece = self._shard(number)[offset : offset + length - filled]
            out[filled : filled + piece.size] = piece
            filled += piece.size
            number += 1
        return out

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__, _maps={})  # maps are re-opened in another process
