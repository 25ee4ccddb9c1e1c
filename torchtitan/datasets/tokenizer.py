"""Tokenizers: one interface, three file formats, told apart by the file's content.

- SentencePiece ``tokenizer.model`` (a protobuf): the project's own small model in
  ``torchtitan/datasets/assets/`` (``scripts/train_tokenizer.py`` regenerates it).
- Meta's Llama 3 ``tokenizer.model`` (the hub's ``original/tokenizer.model``): a tiktoken
  BPE file, one ``base64-token rank`` pair per line. The 256 special tokens follow the
  ranks, so the vocabulary is ranks + 256 (128,256 for Llama 3).
- Hugging Face ``tokenizer.json``, given as the file or its folder; ``tokenizer_config.json``
  beside it names BOS and EOS (and the special tokens, which decode to nothing).

A release folder is accepted as the path too: its ``tokenizer.json``, else its
``tokenizer.model`` or ``original/tokenizer.model``. A Git LFS pointer in place of the file
is named as such.

BOS/EOS are never added implicitly: callers must say what they want, because forgetting
(or doubling) them silently changes what the model learns. Text that spells a special
token (``<|eot_id|>`` in a web page) is encoded as plain text by every backend, so
training data cannot inject control tokens.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterable
from pathlib import Path

from torchtitan.lfs import check_not_lfs_pointer

__all__ = [
    "Tokenizer", "SentencePieceTokenizer", "TiktokenTokenizer", "HFTokenizer", "build_tokenizer",
    "resolve_tokenizer_path", "LLAMA3_SPLIT_PATTERN", "llama3_special_tokens",
]

# The repository root is the parent of the `torchtitan` package directory.
_REPO_ROOT = Path(__file__).resolve().parent.parent.parent

_FORMATS = ("a SentencePiece tokenizer.model, a Llama 3 tiktoken tokenizer.model (lines of 'base64-token rank'), "
            "or a Hugging Face tokenizer.json (the file, or a folder holding it and tokenizer_config.json)")
_HOW_TO_FIX = ("Generate one with `python scripts/train_tokenizer.py` (run from the repository root), or point "
               f"--model.tokenizer_path at {_FORMATS}.")

# Pre-tokenization regex of the Llama 3 tokenizer (part of the format: encodings depend on it).
LLAMA3_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
LLAMA3_NUM_SPECIAL_TOKENS = 256


def llama3_special_tokens() -> list[str]:
    """The 256 special tokens of Llama 3, in id order after the BPE ranks."""
    named = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
             "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>",
             "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
    reserved = [f"<|reserved_special_token_{2 + i}|>" for i in range(LLAMA3_NUM_SPECIAL_TOKENS - len(named))]
    return named + reserved


class Tokenizer:
    """What the data pipeline needs: ``encode``/``decode``, ``n_words``, ``bos_id``, ``eos_id``, ``pad_id``.

    ``kind`` names the backend ("sentencepiece", "tiktoken", "huggingface"); ``files`` lists
    the files that define it (an export copies them next to the weights).
    """

    kind: str = ""
    model_path: str
    files: list[Path]
    n_words: int
    bos_id: int
    eos_id: int
    pad_id: int = -1  # -1: no padding token

    def _encode_plain(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_plain_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, without BOS/EOS (the token store's preparation calls this)."""
        return [self._encode_plain(t) for t in texts]

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        """Token ids of ``text``, optionally framed by BOS and/or EOS."""
        ids = self._encode_plain(text)
        if bos:
            ids.insert(0, self.bos_id)
        if eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; BOS/EOS (and other special tokens) decode to nothing."""
        raise NotImplementedError

    def byte_lengths(self) -> list[int]:
        """The UTF-8 bytes of text each token id stands for (bits per byte divide by them;
        ``datasets/token_bytes.py``). Here: each token decoded alone, exact for whole characters."""
        return [len(self.decode([i]).encode("utf-8")) for i in range(self.n_words)]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(model_path={self.model_path!r}, n_words={self.n_words})"


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model file (the project's own tokenizer)."""

    kind = "sentencepiece"

    def __init__(self, model_path: str) -> None:
        from sentencepiece import SentencePieceProcessor

        self.model_path, self.files = model_path, [Path(model_path)]
        self._sp = SentencePieceProcessor()
        try:
            self._sp.Load(model_path)
        except (OSError, RuntimeError) as exc:
            raise ValueError(f"{model_path!r} is none of the supported formats ({exc}); expected {_FORMATS}. "
                             f"{_HOW_TO_FIX}") from exc
        self.n_words = self._sp.vocab_size()
        self.bos_id, self.eos_id, self.pad_id = self._sp.bos_id(), self._sp.eos_id(), self._sp.pad_id()
        if self.bos_id < 0 or self.eos_id < 0:
            raise ValueError(f"{model_path!r} defines no BOS/EOS pieces, which packing relies on. {_HOW_TO_FIX}")

    def _encode_plain(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_plain_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(texts)  # one call: sentencepiece tokenizes the list in C++

    def decode(self, ids: Iterable[int]) -> str:
        # int() also accepts 0-d tensors and numpy integers.
        return self._sp.decode([int(i) for i in ids])

    def byte_lengths(self) -> list[int]:
        """Exact: a piece's text with its word-boundary mark as a space; a byte-fallback piece one byte;
        control and unknown pieces none."""
        sp, out = self._sp, []
        for i in range(self.n_words):
            if sp.is_control(i) or sp.is_unknown(i):
                out.append(0)
            elif sp.is_byte(i):
                out.append(1)
            else:
                out.append(len(sp.id_to_piece(i).replace("\u2581", " ").encode("utf-8")))
        return out


def read_tiktoken_ranks(path: str) -> dict[bytes, int]:
    """``{token bytes: rank}`` of a tiktoken BPE file; ValueError naming the first bad line.

    Parsed here rather than by ``tiktoken.load.load_tiktoken_bpe``, which caches files by
    path in a temporary folder (a changed file at the same path would read stale).
    """
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError as e:
                raise ValueError(f"{path!r} line {number} is not 'base64-token rank'") from e
    if not ranks:
        raise ValueError(f"{path!r} holds no BPE ranks")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path!r}: the ranks are not 0..{len(ranks) - 1} without gaps")
    return ranks


class TiktokenTokenizer(Tokenizer):
    """Meta's Llama 3 ``tokenizer.model``: tiktoken BPE ranks + the 256 Llama 3 special tokens."""

    kind = "tiktoken"

    def __init__(self, model_path: str) -> None:
        import tiktoken

        self.model_path, self.files = model_path, [Path(model_path)]
        ranks = read_tiktoken_ranks(model_path)
        specials = llama3_special_tokens()
        self.special_tokens = {tok: len(ranks) + i for i, tok in enumerate(specials)}
        self._enc = tiktoken.Encoding(name=Path(model_path).name, pat_str=LLAMA3_SPLIT_PATTERN,
                                      mergeable_ranks=ranks, special_tokens=self.special_tokens)
        self.n_words = len(ranks) + len(specials)
        self.bos_id = self.special_tokens["<|begin_of_text|>"]
        self.eos_id = self.special_tokens["<|end_of_text|>"]
        self._special_ids = set(self.special_tokens.values())

    def _encode_plain(self, text: str) -> list[int]:
        # Special-token text is ordinary text here (see the module docstring).
        return self._enc.encode(text, allowed_special=set(), disallowed_special=())

    def encode_plain_batch(self, texts: list[str]) -> list[list[int]]:
        return self._enc.encode_batch(texts, allowed_special=set(), disallowed_special=())

    def decode(self, ids: Iterable[int]) -> str:
        return self._enc.decode([i for i in (int(i) for i in ids) if i not in self._special_ids])

    def byte_lengths(self) -> list[int]:
        """Exact: each rank's bytes; special tokens none."""
        return [0 if i in self._special_ids else len(self._enc.decode_single_token_bytes(i))
                for i in range(self.n_words)]


def _token_content(value) -> str | None:
    """A token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizer.json``; BOS/EOS come from ``tokenizer_config.json`` beside it."""

    kind = "huggingface"

    def __init__(self, model_path: str) -> None:
        from tokenizers import Tokenizer as _HFTokenizer

        path = Path(model_path)
        folder = path if path.is_dir() else path.parent
        json_file = folder / "tokenizer.json" if path.is_dir() else path
        config_file = folder / "tokenizer_config.json"
        self.model_path, self.files = model_path, [json_file] + ([config_file] if config_file.is_file() else [])
        try:
            self._tok = _HFTokenizer.from_file(str(json_file))
        except Exception as e:  # tokenizers raises a bare Exception for a bad file
            raise ValueError(f"{str(json_file)!r} is not a valid Hugging Face tokenizer.json ({e})") from e
        # Special-token text is ordinary text here (see the module docstring).
        self._tok.encode_special_tokens = True
        if not config_file.is_file():
            raise ValueError(f"{str(json_file)!r}: no tokenizer_config.json beside it to name BOS and EOS; put the "
                             "one that came with tokenizer.json in the same folder")
        config = json.loads(config_file.read_text())
        ids = {}
        for role in ("bos", "eos"):
            token = _token_content(config.get(f"{role}_token"))
            token_id = self._tok.token_to_id(token) if token is not None else None
            if token_id is None:
                raise ValueError(f"{str(config_file)!r}: {role}_token {token!r} is not a token of {str(json_file)!r}; "
                                 "packing needs both BOS and EOS")
            ids[role] = token_id
        self.bos_id, self.eos_id = ids["bos"], ids["eos"]
        pad = _token_content(config.get("pad_token"))
        pad_id = self._tok.token_to_id(pad) if pad is not None else None
        self.pad_id = -1 if pad_id is None else pad_id
        self.n_words = self._tok.get_vocab_size(with_added_tokens=True)
        self._special_ids = self._declared_special_ids(config)

    def _declared_special_ids(self, config: dict) -> set[int]:
        """Ids of the special tokens tokenizer_config.json declares: BOS/EOS/pad/unk, the additional
        ones and every ``added_tokens_decoder`` entry marked special. tokenizer.json alone may leave them
        unmarked, and ``skip_special_tokens`` skips only what it marks."""
        names = [_token_content(config.get(f"{role}_token")) for role in ("bos", "eos", "pad", "unk")]
        names += [_token_content(t) for t in config.get("additional_special_tokens") or []]
        ids = {self._tok.token_to_id(n) for n in names if n is not None}
        for key, entry in (config.get("added_tokens_decoder") or {}).items():
            if isinstance(entry, dict) and entry.get("special") and str(key).isdigit():
                ids.add(int(key))
        return {i for i in ids if i is not None}

    def _encode_plain(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_plain_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([i for i in (int(i) for i in ids) if i not in self._special_ids],
                                skip_special_tokens=True)


def resolve_tokenizer_path(path: str) -> str:
    """Find the tokenizer: as given (absolute or relative to the cwd), else relative to the repo root.

    The repo-root fallback lets the default config entry
    (``torchtitan/datasets/assets/tokenizer.model``) work from any directory.
    """
    expanded = os.path.expanduser(path)
    candidates = [Path(expanded)]
    if not os.path.isabs(expanded):
        candidates.append(_REPO_ROOT / expanded)
    for candidate in candidates:
        if candidate.is_file() or (candidate / "tokenizer.json").is_file():
            return str(candidate)
        # A release's original/ folder, or the release folder holding only Meta's file there.
        for inner in (candidate / "tokenizer.model", candidate / "original" / "tokenizer.model"):
            if inner.is_file():
                return str(inner)
    tried = ", ".join(repr(str(c)) for c in candidates)
    raise FileNotFoundError(f"Tokenizer {path!r} not found (tried {tried}). {_HOW_TO_FIX}")


def tokenizer_format(path: str) -> str:
    """"huggingface", "tiktoken" or "sentencepiece", judged from the content, never the name."""
    p = Path(path)
    if p.is_dir():
        return "huggingface"
    with open(p, "rb") as f:
        head = f.read(4096)
    stripped = head.lstrip()
    if stripped.startswith(b"{"):
        return "huggingface"
    first_line = head.split(b"\n", 1)[0].strip()
    parts = first_line.split()
    if len(parts) == 2 and parts[1].isdigit():
        try:
            base64.b64decode(parts[0], validate=True)
            return "tiktoken"
        except ValueError:
            pass
    return "sentencepiece"


_BACKENDS = {"huggingface": HFTokenizer, "tiktoken": TiktokenTokenizer, "sentencepiece": SentencePieceTokenizer}


def build_tokenizer(path: str) -> Tokenizer:
    """The tokenizer at ``path`` (see ``resolve_tokenizer_path``), its backend chosen by content."""
    resolved = resolve_tokenizer_path(path)
    check_not_lfs_pointer(resolved if Path(resolved).is_file() else Path(resolved) / "tokenizer.json")
    return _BACKENDS[tokenizer_format(resolved)](resolved)
