"""Token store: a corpus tokenized once into memory-mapped shards, read by window index.

Layout of a store folder
------------------------
``index.json``
    Format version, token dtype, vocabulary size, fingerprints of the tokenizer
    and of the source, the held-out split the store was filtered with, and one
    entry per shard (file name, tokens, documents).
``shard_00000.bin`` ...
    The token ids of consecutive documents, each framed by BOS and EOS, as a
    raw little-endian array (``uint16`` when the vocabulary fits, else ``uint32``).
``shard_00000.docs.npy`` ...
    The end offset of every document inside the shard (document boundaries).

The shards concatenated are exactly the token stream the packing loader used to
build on the fly, so global window ``i`` is the ``seq_len + 1`` tokens starting
at token ``i * (seq_len + 1)``: any window is read in constant time, and a rank
reads (memory-maps and touches) only its own windows.

Writing is atomic. A store is prepared in ``<folder>.partial``; every finished
shard is published there with ``os.replace`` and a marker file written last. The
index is written only when every shard is done, and the folder is then renamed
to its final name, so a folder with an ``index.json`` is always whole. After a
kill (or a full disk) the next preparation keeps the finished shards.

The held-out split (``split.py``) is applied while preparing: the documents it
holds out never enter the store, and the store records the split, so a run with
another split cannot read it by mistake.

Malformed input stops preparation with ``file:line`` in the message: skipping a
line silently would change the data the run trains on.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan.datasets.split import HeldOutSplit

__all__ = [
    "TokenStore",
    "TokenStoreError",
    "WindowPermutation",
    "ensure_store",
    "file_fingerprint",
    "is_store",
    "iter_local_documents",
    "prepare_store",
    "source_files",
]

logger = logging.getLogger(__name__)

FORMAT = "torchtitan-token-store"
VERSION = 1
INDEX_NAME = "index.json"
PARTIAL_SUFFIX = ".partial"
DEFAULT_SHARD_CHARS = 64 << 20  # ~16M tokens per shard for English text
_LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet", ".txt")


class TokenStoreError(ValueError):
    """A token store or its source cannot be used; the message names the folder or file and the fix."""


# ----------------------------------------------------------------- fingerprints


def file_fingerprint(path: str | os.PathLike, *, full: bool = True) -> str:
    """sha256 of a file's bytes; with ``full=False`` only of its size, head and tail (cheap for huge files)."""
    h = hashlib.sha256()
    p = Path(path)
    size = p.stat().st_size
    with open(p, "rb") as f:
        if full or size <= 4 << 20:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        else:
            h.update(str(size).encode())
            h.update(f.read(1 << 20))
            f.seek(size - (1 << 20))
            h.update(f.read(1 << 20))
    return h.hexdigest()


def tokenizer_fingerprint(path: str | os.PathLike) -> str:
    """sha256 of the tokenizer: its file, or a Hugging Face folder's tokenizer.json and tokenizer_config.json."""
    p = Path(path)
    if p.is_file():
        return file_fingerprint(p)
    h = hashlib.sha256()
    for f in (p / "tokenizer.json", p / "tokenizer_config.json"):
        if f.is_file():
            h.update(f.name.encode() + b"\0" + file_fingerprint(f).encode())
    return h.hexdigest()


def source_files(path: str) -> list[Path]:
    """The local files a dataset path names: the file, or the supported files of a folder in sorted order."""
    root = Path(os.path.expanduser(path))
    if not root.exists():
        raise FileNotFoundError(f"dataset_path {path!r} does not exist")
    if root.is_file():
        return [root]
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in _LOCAL_SUFFIXES)


def source_fingerprint(files: list[Path]) -> str:
    """Names, sizes and (head/tail) contents of the source files: any edit gives another store."""
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode() + b"\0" + file_fingerprint(p, full=False).encode())
    return h.hexdigest()


def split_text(split: HeldOutSplit | None, held_out: bool = False) -> str | None:
    """How a store's documents were chosen: None (all), the training side of a split, or its held-out side."""
    if split is None:
        return None
    text = f"held_out_fraction={split.fraction}, split_seed={split.seed}"
    return f"only the documents held out by {text}" if held_out else text


# ---------------------------------------------------------------------- reading source


def _record_text(record: Any, text_field: str, where: str) -> str:
    if not isinstance(record, dict) or text_field not in record:
        fields = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise TokenStoreError(f"{where}: record has no {text_field!r} field (fields: {fields})")
    text = record[text_field]
    if text is not None and not isinstance(text, str):
        raise TokenStoreError(f"{where}: field {text_field!r} is {type(text).__name__}, not text")
    return text or ""


def _iter_json(path: Path, text_field: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        head = f.read(1)
        while head.isspace():
            head = f.read(1)
        f.seek(0)
        if head == "[":  # one JSON array of records
            try:
                records = json.load(f)
            except json.JSONDecodeError as e:
                raise TokenStoreError(f"{path}:{e.lineno}: malformed JSON ({e.msg}); fix or remove it") from None
            for number, record in enumerate(records):
                yield _record_text(record, text_field, f"{path}[{number}]")
            return
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise TokenStoreError(
                    f"{path}:{lineno}: malformed JSON line ({e.msg}); preparation stops rather than train on "
                    "silently changed data: fix or remove the line and rerun (finished shards are kept)"
                ) from None
            yield _record_text(record, text_field, f"{path}:{lineno}")


def _iter_with_datasets(path: Path, text_field: str) -> Iterator[str]:
    # Parquet and plain text read exactly as the streaming loader reads them.
    from torchtitan.datasets.hf_datasets import load_local_dataset

    for number, record in enumerate(load_local_dataset(str(path))):
        yield _record_text(record, text_field, f"{path} record {number}")


def iter_local_documents(files: Iterable[Path], text_field: str = "text") -> Iterator[str]:
    """Document texts of local files in order (empty documents skipped, as the packing loader does)."""
    for path in files:
        reader = _iter_json if path.suffix.lower() in (".json", ".jsonl") else _iter_with_datasets
        for text in reader(path, text_field):
            if text:
                yield text


# ------------------------------------------------------------------------ writing


def _dtype_for(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def _write_array(path: Path, array: np.ndarray) -> None:
    """Write to a temporary name and publish with ``os.replace``: a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        if path.suffix == ".npy":
            np.save(f, array)
        else:
            f.write(array.tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


_WORKER_TOKENIZER = None


def _init_worker(tokenizer_path: str) -> None:
    global _WORKER_TOKENIZER
    from torchtitan.datasets.tokenizer import build_tokenizer

    _WORKER_TOKENIZER = build_tokenizer(tokenizer_path)


def _tokenize_shard(task: tuple[int, list[str], str, str]) -> dict[str, Any]:
    """Tokenize one shard's documents and publish its files (runs in a worker or in-process)."""
    number, texts, folder, dtype = task
    tok = _WORKER_TOKENIZER
    pieces = tok.encode_plain_batch(texts)
    lengths = np.fromiter((len(p) + 2 for p in pieces), dtype=np.int64, count=len(pieces))
    ends = np.cumsum(lengths)
    tokens = np.empty(int(ends[-1]) if len(ends) else 0, dtype=dtype)
    start = 0
    for p, end in zip(pieces, ends):
        tokens[start] = tok.bos_id
        tokens[start + 1 : end - 1] = p
        tokens[end - 1] = tok.eos_id
        start = int(end)
    base = Path(folder) / f"shard_{number:05d}"
    _write_array(base.with_suffix(".bin"), tokens)
    _write_array(base.with_suffix(".docs.npy"), ends.astype(np.uint64))
    meta = {"file": base.name + ".bin", "tokens": int(tokens.size), "documents": len(texts)}
    _write_json(base.with_suffix(".done.json"), meta)  # last: marks the shard finished
    return meta


def _chunks(documents: Iterable[str], shard_chars: int) -> Iterator[list[str]]:
    chunk: list[str] = []
    size = 0
    for text in documents:
        chunk.append(text)
        size += len(text)
        if size >= shard_chars:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _finished_shard(folder: Path, number: int, dtype: np.dtype) -> dict[str, Any] | None:
    base = folder / f"shard_{number:05d}"
    try:
        meta = json.loads(base.with_suffix(".done.json").read_text())
        if base.with_suffix(".bin").stat().st_size == meta["tokens"] * dtype.itemsize:
            return meta
    except (OSError, ValueError, KeyError):
        pass
    return None


def prepare_store(
    *,
    documents: Iterable[str],
    out_dir: str | os.PathLike,
    tokenizer_path: str,
    source: dict[str, Any],
    split: HeldOutSplit | None = None,
    held_out: bool = False,
    workers: int = 1,
    shard_chars: int = DEFAULT_SHARD_CHARS,
    progress: bool = True,
) -> Path:
    """Tokenize ``documents`` into a store at ``out_dir`` (atomically; resumes a ``.partial`` folder).

    ``source`` describes the data (it must contain a ``fingerprint``); it is recorded in the index.
    With ``split`` the documents it holds out are left out of the store, or, with
    ``held_out``, only those are kept (a validation store).
    """
    from torchtitan.datasets.tokenizer import build_tokenizer

    out = Path(out_dir)
    if (out / INDEX_NAME).exists():
        return out
    tokenizer = build_tokenizer(tokenizer_path)
    dtype = _dtype_for(tokenizer.n_words)
    header = {
        "format": FORMAT, "version": VERSION, "dtype": dtype.name, "vocab_size": tokenizer.n_words,
        "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id,
        "tokenizer": {"path": os.path.abspath(tokenizer_path), "sha256": tokenizer_fingerprint(tokenizer_path)},
        "source": source, "split": split_text(split, held_out), "shard_chars": shard_chars,
    }
    partial = out.with_name(out.name + PARTIAL_SUFFIX)
    partial.mkdir(parents=True, exist_ok=True)
    plan_file = partial / "plan.json"
    if plan_file.exists() and json.loads(plan_file.read_text()) != header:
        logger.warning("%s: left by a preparation with other settings; starting it again", partial)
        shutil.rmtree(partial)
        partial.mkdir(parents=True)
    if not plan_file.exists():
        _write_json(plan_file, header)

    if split is not None:
        documents = (text for text in documents if split.held_out(text) == held_out)
    shards: list[dict[str, Any]] = []
    kept = 0

    def tasks() -> Iterator[tuple[int, list[str], str, str]]:
        nonlocal kept
        for number, texts in enumerate(_chunks(documents, shard_chars)):
            done = _finished_shard(partial, number, dtype)
            if done is not None:
                kept += 1
                shards.append(done)  # in order: finished shards are never handed to a worker
                continue
            shards.append({"pending": number})
            yield number, texts, str(partial), dtype.name

    bar = _progress(progress, str(out))
    pool = None
    try:
        if workers <= 1:
            _init_worker(tokenizer_path)
            results = map(_tokenize_shard, tasks())
        else:
            import multiprocessing as mp

            # fork: a worker starts in milliseconds (spawn would re-import torch in each one).  The workers run
            # only SentencePiece and NumPy, so no lock another thread holds at the fork is ever touched.
            method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
            pool = mp.get_context(method).Pool(workers, initializer=_init_worker, initargs=(tokenizer_path,))
            results = pool.imap(_tokenize_shard, tasks())
        for meta in results:
            number = int(meta["file"][len("shard_"):-len(".bin")])
            shards[number] = meta
            bar.update(meta["tokens"])
        if pool is not None:
            pool.close()
            pool.join()
            pool = None
    except OSError as e:
        cause = "free disk space" if e.errno == errno.ENOSPC else "fix the cause"
        raise OSError(
            e.errno, f"preparing token store {out}: {e.strerror or e} ({e.filename or partial}); "
            f"the unfinished store in {partial} is not used; {cause} and rerun: finished shards are kept"
        ) from e
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
    if kept:
        logger.info("%s: kept %d finished shard(s) from an interrupted preparation", out, kept)
    index = dict(header, shards=shards, total_tokens=sum(s["tokens"] for s in shards),
                 total_documents=sum(s["documents"] for s in shards))
    _write_json(partial / INDEX_NAME, index)
    (partial / "plan.json").unlink()
    os.replace(partial, out)  # a folder with an index is always whole
    logger.info("Prepared token store %s: %s tokens, %s documents, %d shard(s)", out,
                f"{index['total_tokens']:,}", f"{index['total_documents']:,}", len(shards))
    return out


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(enabled: bool, label: str):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(desc=f"tokenizing -> {label}", unit=" tok", unit_scale=True, mininterval=1.0)


# --------------------------------------------------------------------------- reading


def is_store(path: str | os.PathLike) -> bool:
    return (Path(path) / INDEX_NAME).is_file()


def looks_like_store(path: Path) -> bool:
    """A folder of store files (shards, or a preparation marker) -- with or without its index."""
    return path.is_dir() and (any(path.glob("shard_*.bin")) or (path / "plan.json").exists())


class TokenStore:
    """Read-only view of a prepared store; shards are memory-mapped on first use."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
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
        self.index = index
        self.dtype = np.dtype(index["dtype"])
        self.shard_files = [self.path / s["file"] for s in index["shards"]]
        sizes = [int(s["tokens"]) for s in index["shards"]]
        for file, tokens in zip(self.shard_files, sizes):
            try:
                actual = file.stat().st_size
            except FileNotFoundError:
                raise TokenStoreError(f"token store {self.path}: shard {file} is missing; prepare the store again") from None
            if actual != tokens * self.dtype.itemsize:
                raise TokenStoreError(
                    f"token store {self.path}: shard {file} has {actual} bytes, the index says "
                    f"{tokens * self.dtype.itemsize} (truncated or replaced); prepare the store again"
                )
        self.starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self.n_tokens = int(self.starts[-1])
        self._maps: dict[int, np.ndarray] = {}

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps({k: self.index[k] for k in ("tokenizer", "source", "split", "total_tokens")},
                                         sort_keys=True).encode()).hexdigest()[:16]

    def check_tokenizer(self, tokenizer_path: str, vocab_size: int) -> None:
        theirs = self.index["tokenizer"]
        if theirs["sha256"] != tokenizer_fingerprint(tokenizer_path) or self.index["vocab_size"] != vocab_size:
            raise TokenStoreError(
                f"token store {self.path} was prepared with the tokenizer {theirs['path']} (sha256 "
                f"{theirs['sha256'][:12]}), but this run uses {tokenizer_path}: its token ids would be wrong; "
                "prepare the store with this run's tokenizer (scripts/prepare_data.py --tokenizer ...)"
            )

    def check_split(self, split: HeldOutSplit | None) -> None:
        if self.index.get("split") != split_text(split):
            raise TokenStoreError(
                f"token store {self.path} was prepared with {self.index.get('split') or 'nothing held out'}, "
                f"but this run holds out {split_text(split) or 'nothing'}: held-out documents would reach training "
                "(or training data would go missing); prepare it with the run's --validation.held_out_fraction "
                "and --validation.split_seed"
            )

    def check_held_out_side(self, split: HeldOutSplit | None) -> None:
        """A store of held-out documents validates only the run that holds out those documents."""
        theirs = self.index.get("split") or ""
        if theirs.startswith("only the documents held out") and theirs != split_text(split, held_out=True):
            raise TokenStoreError(
                f"token store {self.path} holds {theirs}, but this run holds out {split_text(split) or 'nothing'}: "
                "training would see some of the validation documents; give the run that split (or prepare the "
                "held-out side of the run's split)"
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


# ---------------------------------------------------------------------- window order


def _mix(x: np.ndarray) -> np.ndarray:
    # splitmix64 finalizer; uint64 arithmetic wraps, which is what we want.
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


class WindowPermutation:
    """A seeded permutation of ``range(n)`` evaluated per index in O(1) time and memory.

    A balanced Feistel network over the smallest even number of bits covering
    ``n`` is a bijection; indices that land outside ``range(n)`` are walked
    through the network again until they land inside (cycle walking), which
    keeps it a bijection of ``range(n)``.  Nothing of size ``n`` is ever built,
    so a resume at window 10^9 costs what one at window 0 costs.
    """

    ROUNDS = 4

    def __init__(self, n: int, seed: int, epoch: int) -> None:
        self.n = n
        bits = max(2, (max(n, 1) - 1).bit_length())
        bits += bits % 2
        self.half = np.uint64(bits // 2)
        self.mask = np.uint64((1 << (bits // 2)) - 1)
        digest = hashlib.blake2b(f"{seed}:{epoch}".encode(), digest_size=8 * self.ROUNDS).digest()
        self.keys = [np.uint64(int.from_bytes(digest[8 * i : 8 * i + 8], "little")) for i in range(self.ROUNDS)]

    def _round_trip(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right ^ key) & self.mask)
        return (left << self.half) | right

    def _one(self, x: int) -> int:
        # The same network on Python ints: a step's few windows cost microseconds, not NumPy call overheads.
        half, mask, n = int(self.half), int(self.mask), self.n
        keys = [int(k) for k in self.keys]
        while True:
            left, right = x >> half, x & mask
            for key in keys:
                z = right ^ key
                z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
                z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
                left, right = right, left ^ ((z ^ (z >> 31)) & mask)
            x = (left << half) | right
            if x < n:
                return x

    def __call__(self, indices: np.ndarray) -> np.ndarray:
        indices = np.asarray(indices)
        if indices.size <= 64:
            return np.array([self._one(int(i)) for i in indices.ravel()], dtype=np.int64).reshape(indices.shape)
        x = self._round_trip(indices.astype(np.uint64))
        outside = x >= np.uint64(self.n)
        while outside.any():
            x[outside] = self._round_trip(x[outside])
            outside = x >= np.uint64(self.n)
        return x.astype(np.int64)


# ------------------------------------------------------------- prepare on first use


@contextlib.contextmanager
def _file_lock(path: Path, timeout_s: float, what: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        deadline = time.monotonic() + timeout_s
        waited = False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if not waited:
                    logger.info("Waiting for another process to prepare %s (lock %s)", what, path)
                    waited = True
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"waited {timeout_s:.0f} s for another process to prepare {what} (lock {path} held); "
                        "if no preparation is running, a stale process holds it: end it, or prepare the store "
                        "beforehand with scripts/prepare_data.py and pass it as --training.dataset_path"
                    ) from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@dataclass(frozen=True)
class SourceSpec:
    """What to prepare: a label for folder names, a fingerprint, and a way to read the documents."""

    label: str
    fingerprint: str
    files: tuple[Path, ...]
    text_field: str = "text"

    def documents(self) -> Iterator[str]:
        return iter_local_documents(self.files, self.text_field)


def ensure_store(
    spec: SourceSpec,
    *,
    tokenizer_path: str,
    split: HeldOutSplit | None,
    cache_dir: str,
    held_out: bool = False,
    workers: int = 1,
    lock_timeout_s: float = 3600.0,
) -> Path:
    """The cached store of ``spec`` for this tokenizer and split side, prepared under a file lock on first use.

    Every process calls this; the first one to take the lock prepares, the
    others wait for it and then find the finished store.  Several ranks (or
    several jobs sharing the cache) therefore never race and never prepare twice.
    """
    key_data = {"version": VERSION, "tokenizer": tokenizer_fingerprint(tokenizer_path), "source": spec.fingerprint,
                "split": split_text(split, held_out)}
    key = hashlib.sha256(json.dumps(key_data, sort_keys=True).encode()).hexdigest()[:16]
    root = Path(cache_dir).expanduser() / "token_stores"
    out = root / f"{spec.label}-{key}"
    if is_store(out):
        return out
    with _file_lock(root / f"{spec.label}-{key}.lock", lock_timeout_s, f"token store {out}"):
        if is_store(out):  # prepared by the process we waited for
            return out
        return prepare_store(
            documents=spec.documents(), out_dir=out, tokenizer_path=tokenizer_path,
            source={"label": spec.label, "files": [str(p) for p in spec.files], "fingerprint": spec.fingerprint},
            split=split, held_out=held_out, workers=workers, progress=False,
        )


def write_synthetic_store(out_dir: str | os.PathLike, n_tokens: int, *, shard_tokens: int = 1 << 24) -> Path:
    """A store whose token ``t`` is ``t`` (uint32), for tests and benchmarks: a window's first token names it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards = []
    for number, start in enumerate(range(0, n_tokens, shard_tokens)):
        tokens = np.arange(start, min(start + shard_tokens, n_tokens), dtype=np.uint32)
        _write_array(out / f"shard_{number:05d}.bin", tokens)
        shards.append({"file": f"shard_{number:05d}.bin", "tokens": int(tokens.size), "documents": 1})
    index = {"format": FORMAT, "version": VERSION, "dtype": "uint32", "vocab_size": 2**32, "bos_id": 0, "eos_id": 0,
             "tokenizer": {"path": "synthetic", "sha256": "synthetic"}, "source": {"fingerprint": "synthetic"},
             "split": None, "shard_chars": 0, "shards": shards, "total_tokens": n_tokens, "total_documents": len(shards)}
    _write_json(out / INDEX_NAME, index)
    return out
