"""SentencePiece tokenizer (Llama 2 style ``tokenizer.model``).

The project ships a small model in ``torchtitan/datasets/assets/`` that
``scripts/train_tokenizer.py`` regenerates.  BOS/EOS are never added
implicitly: callers must say what they want, because forgetting (or doubling)
them silently changes what the model learns.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from sentencepiece import SentencePieceProcessor

__all__ = ["Tokenizer", "build_tokenizer", "resolve_tokenizer_path"]

# The repository root is the parent of the `torchtitan` package directory.
_REPO_ROOT = Path(__file__).resolve().parent.parent.parent

_HOW_TO_FIX = "Generate one with `python scripts/train_tokenizer.py` (run from the repository root), or point the config at an existing SentencePiece tokenizer.model."


class Tokenizer:
    """Thin, explicit wrapper around a SentencePiece model file."""

    def __init__(self, model_path: str) -> None:
        self.model_path = model_path
        self._sp = SentencePieceProcessor()
        try:
            self._sp.Load(model_path)
        except (OSError, RuntimeError) as exc:
            # SentencePiece reports a bad file as a bare parse error; name the
            # file so the user knows which config entry is wrong.
            raise ValueError(
                f"{model_path!r} is not a valid SentencePiece model ({exc}). {_HOW_TO_FIX}"
            ) from exc
        self.n_words: int = self._sp.vocab_size()
        self.bos_id: int = self._sp.bos_id()
        self.eos_id: int = self._sp.eos_id()
        # -1 when the model defines no padding piece (the shipped one does not).
        self.pad_id: int = self._sp.pad_id()
        if self.bos_id < 0 or self.eos_id < 0:
            raise ValueError(f"{model_path!r} defines no BOS/EOS pieces, which packing relies on. {_HOW_TO_FIX}")

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        """Token ids of ``text``, optionally framed by BOS and/or EOS."""
        ids: list[int] = self._sp.encode(text)
        if bos:
            ids.insert(0, self.bos_id)
        if eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; control pieces (BOS/EOS) decode to nothing."""
        # int() also accepts 0-d tensors and numpy integers.
        return self._sp.decode([int(i) for i in ids])

    def __repr__(self) -> str:
        return f"Tokenizer(model_path={self.model_path!r}, n_words={self.n_words})"


def resolve_tokenizer_path(path: str) -> str:
    """Find the model file: as given (absolute or relative to the cwd), else relative to the repo root.

    The repo-root fallback lets the default config entry
    (``torchtitan/datasets/assets/tokenizer.model``) work from any directory.
    """
    expanded = os.path.expanduser(path)
    candidates = [Path(expanded)]
    if not os.path.isabs(expanded):
        candidates.append(_REPO_ROOT / expanded)
    for candidate in candidates:
        if candidate.is_file():
            return str(candidate)
    tried = ", ".join(repr(str(c)) for c in candidates)
    raise FileNotFoundError(f"Tokenizer model {path!r} not found (tried {tried}). {_HOW_TO_FIX}")


def build_tokenizer(path: str) -> Tokenizer:
    """Load the SentencePiece model at ``path`` (see ``resolve_tokenizer_path``)."""
    return Tokenizer(resolve_tokenizer_path(path))
