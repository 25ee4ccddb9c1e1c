"""The store cache: local sources prepared into a token store on first use, once, under a file lock.

Every process of a run (and every job sharing the cache) asks for the store of the
same (source, tokenizer, split side); the first to take the folder's lock prepares
it, the others wait and then find it finished, so nobody races and nothing is
prepared twice. The folder is named by a hash of that identity.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import time
from pathlib import Path

from torchtitan.datasets.prepare import prepare_store
from torchtitan.datasets.sources import SourceSpec, tokenizer_fingerprint
from torchtitan.datasets.split import HeldOutSplit, SplitKey, side_key
from torchtitan.datasets.token_store import VERSION, is_store

__all__ = ["ensure_store"]

logger = logging.getLogger(__name__)


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


def _folder_name(spec: SourceSpec, tokenizer_sha: str, split: object) -> str:
    key_data = {"version": VERSION, "tokenizer": tokenizer_sha, "source": spec.fingerprint, "split": split}
    return f"{spec.label}-{hashlib.sha256(json.dumps(key_data, sort_keys=True).encode()).hexdigest()[:16]}"


def _legacy_store(root: Path, spec: SourceSpec, tokenizer_sha: str, key: SplitKey | None) -> Path | None:
    """The store of this identity prepared before split keys existed, when the cache has one.

    Those folders were named with the split in words; without a split the name has not
    changed. Their index records the words, which ``SplitKey.parse`` reads as the same key.
    """
    if key is None:
        return None
    legacy = root / _folder_name(spec, tokenizer_sha, key.describe())
    return legacy if is_store(legacy) else None


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
    """The cached store of ``spec`` for this tokenizer and split side, prepared under a file lock on first use."""
    key = side_key(split, held_out)
    tokenizer_sha = tokenizer_fingerprint(tokenizer_path)
    root = Path(cache_dir).expanduser() / "token_stores"
    name = _folder_name(spec, tokenizer_sha, None if key is None else key.to_dict())
    out = root / name
    if is_store(out):
        return out
    legacy = _legacy_store(root, spec, tokenizer_sha, key)
    if legacy is not None:
        logger.info("Using token store %s, prepared before split keys existed (its folder name hashes the split "
                    "in words; new stores are named by the key)", legacy)
        return legacy
    with _file_lock(root / f"{name}.lock", lock_timeout_s, f"token store {out}"):
        if is_store(out):  # prepared by the process we waited for
            return out
        return prepare_store(
            documents=spec.documents(), out_dir=out, tokenizer_path=tokenizer_path,
            source={"label": spec.label, "files": [str(p) for p in spec.files], "fingerprint": spec.fingerprint},
            split=split, held_out=held_out, workers=workers, progress=False,
        )
