"""Checksums of checkpoint files: computed while DCP writes them, verified before a load.

Writing: ``ChecksummingWriter`` is DCP's ``FileSystemWriter`` whose streams hash every
byte on its way to the file (xxHash's XXH3-64, a fast non-cryptographic hash: it catches
flipped bits, not tampering), so no file is read a second time. DCP writes each file
front to back and never seeks back, which is what makes the running hash the file's
hash; a stream that ended elsewhere than where its hash stopped is hashed again from
disk instead (``_HashingStream.close``). After its data files, each rank writes the
hashes into a small ``__<rank>.checksums.json``; rank 0 gathers them, with the hash
of DCP's ``.metadata``, into the manifest at commit (``collect``).

The stream also remembers the first ENOSPC/EDQUOT it met: DCP's zip writer turns that
error into "unexpected pos ..." which no longer says "disk full", so ``write_data``
raises the remembered error in its place, and every rank learns of it through DCP's
exception gathering (``torchtitan/checkpoint/space.py`` names it).

In an object store (``RemoteChecksummingWriter``) the same streams wrap fsspec's upload
streams: the hashes are those of the bytes sent, and the side files are objects.

Reading: ``files_read`` asks DCP's load planner which files this rank's load will
touch (plus ``.metadata``, which every rank reads); ``bad_files`` hashes those and
names every one that differs from the manifest.
"""

from __future__ import annotations

import errno
import io
import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import xxhash
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemBase, FileSystemWriter

from torchtitan.checkpoint.location import Location, RemotePath, location, open_binary
from torchtitan.compat import fsspec_file_system_type, fsspec_writer_type

ALGORITHM = "xxh3_64"
SIDECAR_SUFFIX = ".checksums.json"
DCP_METADATA = ".metadata"
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_CHUNK = 8 << 20


def file_checksum(path: Location) -> str:
    """The checksum of a file on disk or in an object store (one sequential read)."""
    h = xxhash.xxh3_64()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


class _HashingStream(io.RawIOBase):
    """A write stream that hashes what passes through it and remembers a full disk."""

    def __init__(self, raw: IO[bytes], path: Location, hashes: _Hashes) -> None:
        super().__init__()
        self.raw, self.path, self.hashes = raw, path, hashes
        self.hash, self.hashed = xxhash.xxh3_64(), 0

    def _guard(self, call, *args):
        try:
            return call(*args)
        except OSError as e:
            if e.errno in _DISK_FULL:
                self.hashes.note_disk_full(e)
            raise

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        n = self._guard(self.raw.write, b)
        view = memoryview(b).cast("B")
        self.hash.update(view if n is None or n == view.nbytes else view[:n])
        self.hashed += view.nbytes if n is None else n
        return n

    def tell(self) -> int:
        return self.raw.tell()

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        if not self.raw.closed:
            self._guard(self.raw.flush)

    def close(self) -> None:
        if self.closed:
            return
        try:
            end = self.raw.tell()
            self._guard(self.raw.close)
        finally:
            super().close()
        # Written front to back, the running hash is the file's; otherwise read it back once.
        self.hashes.record(self.path, self.hash.hexdigest() if end == self.hashed else file_checksum(self.path))


class _Hashes:
    """What the write streams of one writer recorded (thread-safe: DCP may use threads)."""

    def __init__(self) -> None:
        self.checksums: dict[str, str] = {}
        self.disk_full: OSError | None = None
        self._lock = threading.Lock()

    def record(self, path: Location, digest: str) -> None:
        with self._lock:
            self.checksums[path.name] = digest

    def note_disk_full(self, error: OSError) -> None:
        with self._lock:
            self.disk_full = self.disk_full or error

    def renamed(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        old, new = os.fspath(path).rsplit("/", 1)[-1], os.fspath(new_path).rsplit("/", 1)[-1]
        with self._lock:
            if old in self.checksums:
                self.checksums[new] = self.checksums.pop(old)

    def of_data_files(self) -> dict[str, str]:
        with self._lock:
            return {name: digest for name, digest in self.checksums.items() if name != DCP_METADATA}

    def of(self, name: str) -> str | None:
        with self._lock:
            return self.checksums.get(name)


@contextmanager
def _hashed(raw: IO[bytes], path: Location, hashes: _Hashes) -> Iterator[io.IOBase]:
    stream = _HashingStream(raw, path, hashes)
    try:
        yield stream
    finally:
        stream.close()


class _HashingFileSystem(FileSystem):
    """DCP's local file system whose write streams hash as they write."""

    def __init__(self, hashes: _Hashes) -> None:
        super().__init__()
        self.hashes = hashes

    @contextmanager
    def create_stream(self, path, mode: str) -> Iterator[io.IOBase]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        try:
            raw = open(path, mode)
        except OSError as e:
            if e.errno in _DISK_FULL:
                self.hashes.note_disk_full(e)
            raise
        with _hashed(raw, Path(path), self.hashes) as stream:
            yield stream

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)  # DCP writes .metadata.tmp, then renames it
        self.hashes.renamed(path, new_path)


class _HashingFsspecFileSystem(fsspec_file_system_type()):
    """DCP's fsspec file system (object stores) whose upload streams hash what they send."""

    def __init__(self, inner: FileSystemBase, hashes: _Hashes) -> None:
        super().__init__()
        assert isinstance(inner, fsspec_file_system_type())  # the writer's own, holding the store's fsspec instance
        self.fs, self.hashes = inner.fs, hashes

    @contextmanager
    def create_stream(self, path, mode: str) -> Iterator[io.IOBase]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        assert self.fs is not None  # set from the writer's own file system
        raw = open_binary(self.fs, os.fspath(path), mode)
        with _hashed(raw, location(os.fspath(path)), self.hashes) as stream:
            yield stream

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)  # a copy and a delete in an object store; only .metadata is renamed
        self.hashes.renamed(path, new_path)


class ChecksummingWriter(FileSystemWriter):
    """``FileSystemWriter`` that records a checksum of every file it writes (see the module docstring)."""

    def __init__(self, path: str | os.PathLike, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.hashes = _Hashes()
        self.fs = self._hashing_file_system()

    def _hashing_file_system(self) -> FileSystemBase:
        return _HashingFileSystem(self.hashes)

    @property
    def disk_full(self) -> OSError | None:
        return self.hashes.disk_full

    def write_data(self, plan, planner):
        try:
            future = super().write_data(plan, planner)
            future.wait()
        except Exception as e:
            if self.disk_full is not None and self.disk_full is not e:
                raise self.disk_full from e
            raise
        sidecar = location(os.fspath(self.path)) / f"__{plan.storage_data.prefix.strip('_')}{SIDECAR_SUFFIX}"
        sidecar.write_text(json.dumps(self.hashes.of_data_files(), sort_keys=True))
        return future

    def finish(self, metadata, results) -> None:
        try:
            super().finish(metadata, results)
        except Exception as e:
            if self.disk_full is not None and self.disk_full is not e:
                raise self.disk_full from e
            raise

    def metadata_checksum(self) -> str | None:
        return self.hashes.of(DCP_METADATA)


class RemoteChecksummingWriter(ChecksummingWriter, fsspec_writer_type()):
    """``ChecksummingWriter`` into an object store: DCP's ``FsspecWriter`` with hashing upload streams."""

    def _hashing_file_system(self) -> FileSystemBase:
        return _HashingFsspecFileSystem(self.fs, self.hashes)


def checkpoint_writer(path: Location, checksums: bool) -> FileSystemWriter:
    """DCP's writer into ``path``: hashing or not, local or into an object store (where fsync means nothing)."""
    if isinstance(path, RemotePath):
        return RemoteChecksummingWriter(str(path), sync_files=False) if checksums else \
            fsspec_writer_type()(str(path), sync_files=False)
    return ChecksummingWriter(str(path)) if checksums else FileSystemWriter(str(path))


def collect(tmp: Location, metadata_checksum: str | None) -> dict[str, Any]:
    """Rank 0 at commit: every rank's checksums (their side files removed) for the manifest."""
    files: dict[str, str] = {}
    for sidecar in sorted(tmp.glob(f"*{SIDECAR_SUFFIX}"), key=lambda p: p.name):
        files.update(json.loads(sidecar.read_text()))
        sidecar.unlink()
    # .metadata is written by rank 0 in this process; an async save's writer may be gone: hash it here.
    files[DCP_METADATA] = metadata_checksum or file_checksum(tmp / DCP_METADATA)
    return {"algorithm": ALGORITHM, "files": files}


def files_read(state: dict[str, Any], metadata) -> set[str]:
    """The checkpoint files a ``dcp.load`` of ``state`` reads on this rank (planned locally, no collective)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    planner = DefaultLoadPlanner()
    planner.set_up_planner(state, metadata, False)
    plan = planner.create_local_plan()
    return {metadata.storage_data[item.storage_index].relative_path for item in plan.items} | {DCP_METADATA}


def bad_files(path: Location, checksums: dict[str, Any], names: set[str]) -> list[str]:
    """One line per file of ``names`` whose bytes differ from the checksum the manifest recorded."""
    if checksums.get("algorithm") != ALGORITHM:
        return [f"checkpoint {path}: unknown checksum algorithm {checksums.get('algorithm')!r} (expected {ALGORITHM})"]
    expected, lines = checksums.get("files", {}), []
    for name in sorted(names):
        if name not in expected:
            lines.append(f"checkpoint {path}: file {name} has no checksum in the manifest")
            continue
        try:
            actual = file_checksum(path / name)
        except OSError as e:
            lines.append(f"checkpoint {path}: file {name} is unreadable ({e})")
            continue
        if actual != expected[name]:
            lines.append(f"checkpoint {path}: file {name} is corrupt (checksum {actual}, {expected[name]} was "
                         "written)")
    return lines
