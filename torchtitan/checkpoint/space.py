"""Disk space for checkpoints: what a save will write, what the folder has free, and a full disk named.

A save that cannot fit ends the job with ``DiskFullError``: one line on every rank
naming the folder, the bytes needed against the bytes free and the last good
checkpoint, and the exit status ``EXIT_DISK_FULL`` (train.py). The size a save
will write is the previous checkpoint's of the same kind (its manifest lists every
file's size), or, for the first one, the state's own bytes (``state_sizes``).
Nothing here communicates; the manager makes the ranks agree.
"""

from __future__ import annotations

import errno
import os
import pickle
from pathlib import Path
from typing import Any

import torch

from torchtitan.checkpoint.location import Location, RemotePath
from torchtitan.checkpoint.store import read_manifest, scan

# sysexits.h's EX_IOERR: distinct from 1 (a failure) and 2 (a config error); see docs/checkpoint_integrity.md.
EXIT_DISK_FULL = 74
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
# DCP's own bytes around each tensor (torch.save's zip records) and its .metadata: measured on the
# debug model at about 1.2 KiB per tensor; 4 KiB keeps the first save's estimate on the safe side.
_PER_ITEM_OVERHEAD = 4096


class DiskFullError(RuntimeError):
    """A checkpoint save that does not fit; its message is the one line every rank prints."""

    exit_status = EXIT_DISK_FULL


def free_bytes(folder: Path) -> int:
    """Bytes an unprivileged writer may still use on the file system of ``folder`` (or of its nearest parent)."""
    probe = Path(folder).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    st = os.statvfs(probe)
    return st.f_bavail * st.f_frsize


def state_sizes(state: dict[str, Any], prefix: str = "") -> dict[str, int]:
    """The bytes a DCP save of ``state`` writes, per flattened key, as this rank sees it.

    A DTensor counts its global size: DCP writes each shard once and replicas once, so
    the union of every rank's keys (pipeline stages hold different ones; ``rng`` has a key
    per rank) sums to what the save writes across all ranks.
    """
    sizes: dict[str, int] = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            sizes.update(state_sizes(value, f"{name}."))
        elif isinstance(value, torch.Tensor):
            sizes[name] = value.numel() * value.element_size() + _PER_ITEM_OVERHEAD
        elif isinstance(value, (bytes, bytearray)):
            sizes[name] = len(value) + _PER_ITEM_OVERHEAD
        else:
            sizes[name] = len(pickle.dumps(value)) + _PER_ITEM_OVERHEAD
    return sizes


def checkpoint_bytes(path: Location) -> int | None:
    """The bytes of a committed checkpoint, from its manifest; None when unreadable."""
    try:
        return sum(read_manifest(path).get("files", {}).values())
    except ValueError:
        return None


def previous_size(folder: Location, kind: str) -> int | None:
    """The size of the newest committed checkpoint of ``kind`` in ``folder``: what the next such save writes."""
    for _step, path in sorted(scan(folder).committed.items(), reverse=True):
        try:
            if read_manifest(path).get("kind") == kind:
                return checkpoint_bytes(path)
        except ValueError:
            continue
    return None


def last_good(folder: Location) -> str:
    latest = scan(folder).latest()
    return str(scan(folder).committed[latest]) if latest is not None else "none"


def is_disk_full(error: BaseException) -> bool:
    """Whether ``error``, or any error it carries (DCP's per-rank failures, causes), is ENOSPC/EDQUOT."""
    seen: set[int] = set()
    todo: list[Any] = [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, tuple):  # DCP keeps (exception, traceback) per rank
            todo.extend(x for x in e if isinstance(x, BaseException))
            continue
        if isinstance(e, OSError) and e.errno in _DISK_FULL:
            return True
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            todo.extend(failures.values())
    return False


def disk_full_line(folder: Location, step: int, needed: int, free: int, midway: bool) -> str:
    """The one line a full disk ends the job with (``midway``: the save had started, and its folder is removed)."""
    what = ("filled the disk while writing; its partial folder was removed" if midway
            else "does not fit; nothing was written")
    return (f"checkpoint: disk full: the save of step {step} {what} (needs {needed:,} bytes in {folder}, "
            f"{free:,} are free); last good checkpoint: {last_good(folder)}. Free space there, lower "
            "--checkpoint.keep_latest_k, or point --job.dump_folder at a larger disk")


def room_warning(folder: Location, keep_latest_k: int, per_checkpoint: int) -> str | None:
    """A warning when ``folder`` cannot hold ``keep_latest_k`` checkpoints plus the one being written.

    None for an object store: a bucket reports no free space (a quota shows as the store's error).
    """
    if isinstance(folder, RemotePath):
        return None
    listing = scan(folder)
    held = sum(checkpoint_bytes(p) or 0 for p in listing.committed.values())
    free = free_bytes(folder)
    if keep_latest_k > 0:
        # Old checkpoints are deleted as new ones commit: their bytes count as room.
        room, wanted = free + held, (keep_latest_k + 1) * per_checkpoint
        what = f"keep_latest_k + 1 = {keep_latest_k + 1} checkpoints"
    else:
        room, wanted = free, per_checkpoint
        what = "one more checkpoint (keep_latest_k=0 keeps them all)"
    if room >= wanted:
        return None
    return (f"checkpoint: {folder} cannot hold {what} of about {per_checkpoint:,} bytes each: {wanted:,} bytes are "
            f"needed, {room:,} are available; a save will fail with a full disk")
