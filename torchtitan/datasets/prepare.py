"""Writing a token store: tokenize documents into shards, with a pool of worker processes.

Writing is atomic. A store is prepared in ``<folder>.partial``; every finished
shard is published there with ``os.replace`` and a marker file written last. The
index is written only when every shard is done, and the folder is then renamed
to its final name, so a folder with an ``index.json`` is always whole. After a
kill (or a full disk) the next preparation keeps the finished shards.

The held-out split (``split.py``) is applied while preparing: the documents it
holds out never enter the store (or, for a validation store, only they do), and
the store records the split's key, so a run with another split cannot read it by
mistake. The folder layout is described in ``token_store.py``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
from collections.abc import Generator, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import numpy as np

from torchtitan.datasets.sources import tokenizer_fingerprint
from torchtitan.datasets.split import HeldOutSplit, side_key
from torchtitan.datasets.token_store import FORMAT, INDEX_NAME, PLAN_NAME, VERSION

if TYPE_CHECKING:  # imported in the workers only, where they tokenize
    from torchtitan.datasets.tokenizer import Tokenizer

__all__ = ["DEFAULT_SHARD_CHARS", "prepare_store", "write_synthetic_store"]

logger = logging.getLogger(__name__)

PARTIAL_SUFFIX = ".partial"
DEFAULT_SHARD_CHARS = 64 << 20  # ~16M tokens per shard for English text

_Task = tuple[int, list[str], str, str]  # shard number, texts, folder, dtype name


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


class ShardEntry(TypedDict):
    """One shard of the index: its token file, and how many tokens and documents it holds."""

    file: str
    tokens: int
    documents: int


class StoreHeader(TypedDict):
    """Everything a store's index records but its shards (and the plan an interrupted preparation resumes)."""

    format: str
    version: int
    dtype: str
    vocab_size: int
    bos_id: int
    eos_id: int
    tokenizer: dict[str, str]
    source: dict[str, object]
    split: dict[str, object] | None
    shard_chars: int


def _write_json(path: Path, obj: object) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ------------------------------------------------------------------- one shard

_WORKER_TOKENIZER: Tokenizer | None = None


def _init_worker(tokenizer_path: str) -> None:
    global _WORKER_TOKENIZER
    from torchtitan.datasets.tokenizer import build_tokenizer

    _WORKER_TOKENIZER = build_tokenizer(tokenizer_path)


def _tokenize_shard(task: _Task) -> ShardEntry:
    """Tokenize one shard's documents and publish its files (runs in a worker or in-process)."""
    number, texts, folder, dtype = task
    tok = _WORKER_TOKENIZER
    assert tok is not None, "_init_worker runs before any task"
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
    meta = ShardEntry(file=base.name + ".bin", tokens=int(tokens.size), documents=len(texts))
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


def _finished_shard(folder: Path, number: int, dtype: np.dtype) -> ShardEntry | None:
    base = folder / f"shard_{number:05d}"
    try:
        meta = json.loads(base.with_suffix(".done.json").read_text())
        if base.with_suffix(".bin").stat().st_size == meta["tokens"] * dtype.itemsize:
            return ShardEntry(file=str(meta["file"]), tokens=int(meta["tokens"]), documents=int(meta["documents"]))
    except (OSError, ValueError, KeyError):
        pass
    return None


# ------------------------------------------------------------ a whole store


def prepare_store(
    *,
    documents: Iterable[str],
    out_dir: str | os.PathLike,
    tokenizer_path: str,
    source: dict[str, object],
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
    out = Path(out_dir)
    if (out / INDEX_NAME).exists():
        return out
    header = _header(tokenizer_path, source, split, held_out, shard_chars)
    partial = _partial_folder(out, header)
    if split is not None:
        documents = (text for text in documents if split.held_out(text) == held_out)
    shards = _tokenize_shards(documents, out, partial, header, tokenizer_path, workers, progress)
    _publish(out, partial, header, shards)
    return out


def _header(tokenizer_path: str, source: dict[str, object], split: HeldOutSplit | None, held_out: bool,
            shard_chars: int) -> StoreHeader:
    """Everything the index records except its shards: also the plan an interrupted preparation resumes."""
    from torchtitan.datasets.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(tokenizer_path)
    key = side_key(split, held_out)
    return StoreHeader(
        format=FORMAT, version=VERSION, dtype=_dtype_for(tokenizer.n_words).name,
        vocab_size=tokenizer.n_words, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id,
        tokenizer={"path": os.path.abspath(tokenizer_path), "sha256": tokenizer_fingerprint(tokenizer_path)},
        source=source, split=None if key is None else key.to_dict(), shard_chars=shard_chars,
    )


def _partial_folder(out: Path, header: StoreHeader) -> Path:
    """``<out>.partial``, kept when an interrupted preparation had the same plan, else emptied."""
    partial = out.with_name(out.name + PARTIAL_SUFFIX)
    partial.mkdir(parents=True, exist_ok=True)
    plan_file = partial / PLAN_NAME
    if plan_file.exists() and json.loads(plan_file.read_text()) != header:
        logger.warning("%s: left by a preparation with other settings; starting it again", partial)
        shutil.rmtree(partial)
        partial.mkdir(parents=True)
    if not plan_file.exists():
        _write_json(plan_file, header)
    return partial


def _tokenize_shards(documents: Iterable[str], out: Path, partial: Path, header: StoreHeader,
                     tokenizer_path: str, workers: int, progress: bool) -> list[ShardEntry]:
    """Every shard's entry, in order: the finished ones of an interrupted run kept, the others tokenized."""
    dtype = np.dtype(header["dtype"])
    shards: list[ShardEntry | None] = []  # None: tokenized by a worker, filled in below

    def tasks() -> Iterator[_Task]:
        for number, texts in enumerate(_chunks(documents, header["shard_chars"])):
            done = _finished_shard(partial, number, dtype)
            shards.append(done)  # in order: finished shards never go to a worker
            if done is None:
                yield number, texts, str(partial), dtype.name

    bar = _progress(progress, str(out))
    tokenized = 0
    try:
        # closing: an error here still ends the worker pool at once, not when the generator is collected.
        with contextlib.closing(_run_tasks(tasks(), tokenizer_path, workers)) as results:
            for meta in results:
                shards[int(meta["file"][len("shard_"):-len(".bin")])] = meta
                tokenized += 1
                bar.update(meta["tokens"])
    except OSError as e:
        cause = "free disk space" if e.errno == errno.ENOSPC else "fix the cause"
        raise OSError(
            e.errno, f"preparing token store {out}: {e.strerror or e} ({e.filename or partial}); "
            f"the unfinished store in {partial} is not used; {cause} and rerun: finished shards are kept"
        ) from e
    finally:
        bar.close()
    if len(shards) > tokenized:
        logger.info("%s: kept %d finished shard(s) from an interrupted preparation", out, len(shards) - tokenized)
    done = [shard for shard in shards if shard is not None]
    assert len(done) == len(shards), "every pending shard's worker reported"
    return done


def _run_tasks(tasks: Iterator[_Task], tokenizer_path: str, workers: int) -> Generator[ShardEntry, None, None]:
    """Each task's result, in order: in this process, or on a pool of ``workers`` processes."""
    if workers <= 1:
        _init_worker(tokenizer_path)
        yield from map(_tokenize_shard, tasks)
        return
    import multiprocessing as mp

    # fork: a worker starts in milliseconds (spawn would re-import torch in each one).  The workers run
    # only SentencePiece and NumPy, so no lock another thread holds at the fork is ever touched.
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    pool = mp.get_context(method).Pool(workers, initializer=_init_worker, initargs=(tokenizer_path,))
    try:
        yield from pool.imap(_tokenize_shard, tasks)
        pool.close()
        pool.join()
    except BaseException:
        pool.terminate()
        raise


def _publish(out: Path, partial: Path, header: StoreHeader, shards: list[ShardEntry]) -> None:
    """Write the index, then give the folder its final name: a folder with an index is always whole."""
    index = dict(header, shards=shards, total_tokens=sum(s["tokens"] for s in shards),
                 total_documents=sum(s["documents"] for s in shards))
    _write_json(partial / INDEX_NAME, index)
    (partial / PLAN_NAME).unlink()
    os.replace(partial, out)
    logger.info("Prepared token store %s: %s tokens, %s documents, %d shard(s)", out,
                f"{index['total_tokens']:,}", f"{index['total_documents']:,}", len(shards))


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
             "split": None, "shard_chars": 0, "shards": shards, "total_tokens": n_tokens,
             "total_documents": len(shards)}
    _write_json(out / INDEX_NAME, index)
    return out
