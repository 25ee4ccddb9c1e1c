"""Git LFS pointer files: the most common broken download of a model release.

A repository cloned without ``git lfs`` holds, in place of every large file, a small text
file starting ``version https://git-lfs.github.com/spec/v1``. Every reader of tokenizer and
weight files asks ``check_not_lfs_pointer`` first, so the error says what happened instead of
a parse error deep in the file format.
"""

from __future__ import annotations

from pathlib import Path

_POINTER_START = b"version https://git-lfs.github.com/spec/"
# Pointer files are about 130 bytes; a real tokenizer or weight file is far larger.
_MAX_POINTER_BYTES = 1024


def is_lfs_pointer(path: str | Path) -> bool:
    """Whether ``path`` is a Git LFS pointer file rather than the file it points to."""
    p = Path(path)
    try:
        if not p.is_file() or p.stat().st_size > _MAX_POINTER_BYTES:
            return False
        with open(p, "rb") as f:
            return f.read(len(_POINTER_START)) == _POINTER_START
    except OSError:
        return False


def check_not_lfs_pointer(path: str | Path) -> None:
    """Raise ValueError (one line naming the file) when ``path`` is a Git LFS pointer."""
    if is_lfs_pointer(path):
        raise ValueError(f"{path} is a Git LFS pointer, not the file itself: run `git lfs pull` or download it again")
