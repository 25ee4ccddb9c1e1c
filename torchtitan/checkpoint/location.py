"""Where checkpoints live: a local folder (``pathlib.Path``) or an object store URI (``RemotePath``).

``checkpoint.folder`` and ``checkpoint.initial_load_path`` may be fsspec URIs such as
``s3://bucket/prefix`` (``memory://`` serves the fast tests). ``RemotePath`` gives such a URI
the few ``pathlib`` operations the checkpoint code uses (join, list, stat, read, write, remove),
so that code reads one way for both. What cannot be the same is the commit: an object store
has no rename, so a remote save is written straight into ``step-N/`` and committed by its
manifest, written last with a conditional put (``put_if_absent``; see ``store.py``).

Credentials and the endpoint come from the usual AWS variables (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL`` or ``AWS_ENDPOINT_URL_S3``, ``AWS_REGION``),
which botocore, under s3fs, reads itself; its timeouts and retries are ``s3_client.py``'s. Listings
are never served from s3fs's cache: another process (another rank, a killed writer, a second run)
may have changed the prefix since.

A URI is checked before it is used (``uri_problem``): ``s3://`` without a bucket would otherwise
become a local folder named ``s3:`` (fsspec reads ``s3:`` as a relative path), an unknown scheme
an error about credentials, and ``file:///x`` a folder ``file:`` under the dump folder.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, cast

from torchtitan.checkpoint import s3_client

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

_LOCAL_PROTOCOLS = ("file", "local")


def is_remote(spec: str | os.PathLike) -> bool:
    """Whether ``spec`` names an object store (a URI with a protocol other than the local file system)."""
    if isinstance(spec, RemotePath):
        return True
    text = os.fspath(spec)
    return "://" in text and text.split("://", 1)[0] not in _LOCAL_PROTOCOLS


# A scheme and the slashes after its colon: ``s3://b/x``, and the mistyped ``s3:/b/x``, ``s3:///x``, ``s3:b``.
_URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(/*)(.*)$", re.DOTALL)


def uri_problem(spec: str) -> str | None:
    """Why ``spec`` cannot name a checkpoint location, in words that end with the fix; None when it can.

    Refused: an unknown scheme (``foo://``), an object-store URI without a bucket (``s3://``,
    ``s3:///x``), a known scheme with one slash (``s3:/b``), and ``file://`` (give the path itself).
    A path with a colon but no ``://`` and no known scheme before it (``C:/x``, ``run:2``) passes.
    """
    match = _URI.match(spec)
    if match is None:  # is_remote takes anything with :// for a URI
        return None if "://" not in spec else "no storage scheme before ://: give s3://bucket/prefix, or a local path"
    scheme, slashes, rest = match.groups()
    if not slashes:
        return None
    try:
        from fsspec import available_protocols
    except ImportError:
        return "a URI needs fsspec: pip install fsspec"
    if scheme not in available_protocols():
        if len(slashes) < 2:
            return None  # a path such as C:/x
        return (f"unknown storage scheme {scheme}://: give s3://bucket/prefix (another fsspec scheme such as "
                "gs:// or az:// needs its driver), or a local path")
    if scheme in _LOCAL_PROTOCOLS:
        return f"{scheme}:// is not needed for a local folder: give the path itself ({'/' + rest.lstrip('/')})"
    if len(slashes) == 1:
        return f"one slash after {scheme}: is a local path, not a URI: give {scheme}://bucket/prefix"
    if len(slashes) == 2 and rest.split("/", 1)[0]:
        return None
    return f"no bucket after {scheme}://: give {scheme}://bucket/prefix"


def _file_system(url: str) -> AbstractFileSystem:
    try:
        from fsspec.core import url_to_fs
    except ImportError:
        raise ImportError(f"{url}: object storage needs fsspec (pip install fsspec)") from None
    if url.split("://", 1)[0] in s3_client.PROTOCOLS:
        s3_client.apply()  # before the first S3 file system: every later one, DCP's too, has the timeouts
    try:
        fs, _ = url_to_fs(url)
    except ImportError as e:
        raise ImportError(f"{url}: the driver for this storage is not installed ({e}); for s3:// run "
                          "pip install s3fs") from None
    return fs


def open_binary(fs: AbstractFileSystem, path: str, mode: str) -> IO[bytes]:
    """``fs.open(path, mode)`` in a binary mode (``rb``, ``wb``): a file of bytes. fsspec ships no types, and what the
    checker infers from its code (a text wrapper or a buffered file) does not depend on the mode; hence one cast."""
    return cast(IO[bytes], fs.open(path, mode))


@dataclass(frozen=True)
class RemoteStat:
    st_size: int


class RemotePath:
    """A file or prefix in an fsspec file system, with the ``pathlib.Path`` subset the checkpoint code needs."""

    def __init__(self, url: str, fs: AbstractFileSystem | None = None, info: dict | None = None) -> None:
        """``url`` is checked (``uri_problem``: ValueError) unless ``fs`` comes with it, from a checked parent."""
        problem = None if fs is not None else uri_problem(url)
        if problem:
            raise ValueError(f"{url}: {problem}")
        self.url = url.rstrip("/")
        self.protocol = self.url.split("://", 1)[0]
        self.fs = fs if fs is not None else _file_system(self.url)
        self.path = str(self.fs._strip_protocol(self.url))
        self._info = info  # from the listing that found this entry: saves one request per entry

    def __truediv__(self, name: str) -> RemotePath:
        return RemotePath(f"{self.url}/{name}", self.fs)

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"RemotePath({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    @property
    def parent(self) -> RemotePath:
        return RemotePath(self.url.rsplit("/", 1)[0], self.fs)

    def _fresh_info(self) -> dict | None:
        self.fs.invalidate_cache(self.path)
        try:
            return self.fs.info(self.path)
        except FileNotFoundError:
            return None

    def exists(self) -> bool:
        return self._info is not None or self._fresh_info() is not None

    def is_dir(self) -> bool:
        info = self._info or self._fresh_info()
        return info is not None and info.get("type") == "directory"

    def is_file(self) -> bool:
        info = self._info or self._fresh_info()
        return info is not None and info.get("type") == "file"

    def stat(self) -> RemoteStat:
        info = self._info or self._fresh_info()
        if info is None:
            raise FileNotFoundError(self.url)
        return RemoteStat(int(info.get("size") or 0))

    def iterdir(self) -> Iterator[RemotePath]:
        """The entries directly under this prefix, listed now (never from a cache)."""
        self.fs.invalidate_cache(self.path)
        try:
            entries = self.fs.ls(self.path, detail=True)
        except FileNotFoundError:
            return
        for info in entries:
            name = str(info["name"]).rstrip("/").rsplit("/", 1)[-1]
            if name:
                yield RemotePath(f"{self.url}/{name}", self.fs, info)

    def glob(self, pattern: str) -> Iterator[RemotePath]:
        return (entry for entry in self.iterdir() if fnmatch.fnmatch(entry.name, pattern))

    def open(self, mode: str = "rb") -> IO[bytes]:
        return open_binary(self.fs, self.path, mode)

    def read_bytes(self) -> bytes:
        data = self.fs.cat_file(self.path)
        if not isinstance(data, bytes):  # fsspec's code types it str | bytes; a file system returns the bytes
            raise TypeError(f"{self.url}: the file system returned a {type(data).__name__}, not the file's bytes")
        return data

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def write_text(self, text: str) -> int:
        self.fs.pipe_file(self.path, text.encode())
        return len(text)

    def unlink(self, missing_ok: bool = False) -> None:
        try:
            self.fs.rm_file(self.path)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        self.fs.makedirs(self.path, exist_ok=True)  # prefixes exist by their objects; buckets must exist


def store_problems(url: str) -> list[str]:
    """Why ``url`` cannot be used (no driver, an S3 bucket that does not exist or cannot be reached); [] if it can.

    Before any process group, so a missing bucket or missing credentials end the job with one line each
    rank rather than at the first save.
    """
    try:
        path = RemotePath(url)
        if path.protocol in ("s3", "s3a"):
            bucket = RemotePath(f"{path.protocol}://{path.path.split('/', 1)[0]}", path.fs)
            if not bucket.exists():
                return [f"the bucket {bucket} does not exist (or these credentials cannot see it); create it first"]
    except (ImportError, ValueError) as e:  # no driver; a URI that uri_problem refuses
        return [str(e)]
    except Exception as e:  # noqa: BLE001 - credentials, endpoint, network: all are this one problem
        return [s3_client.unanswered_line(e, "cannot reach the store")
                or f"cannot reach the store ({type(e).__name__}: {e}); check AWS_ENDPOINT_URL and the credentials"]
    return []


# A local folder or an object-store prefix; both answer the same ``pathlib`` calls used here.
Location = Path | RemotePath


def location(spec: str | os.PathLike) -> Location:
    """``spec`` as a ``RemotePath`` when it is an object-store URI, else as a ``Path``."""
    if isinstance(spec, RemotePath):
        return spec
    return RemotePath(os.fspath(spec)) if is_remote(spec) else Path(spec).expanduser()


def remove_tree(path: Location) -> None:
    """Delete a folder or prefix and everything under it; a missing one is no error."""
    if isinstance(path, RemotePath):
        path.fs.invalidate_cache(path.path)
        try:
            path.fs.rm(path.path, recursive=True)
        except FileNotFoundError:
            pass
    else:
        shutil.rmtree(path, ignore_errors=True)


def put_if_absent(path: Location, data: bytes) -> None:
    """Create ``path`` holding ``data``, or raise FileExistsError when it exists: one writer wins.

    On S3 this is one PUT with ``If-None-Match: *``, which the store answers 412 when the
    object exists (two writers can never both succeed); locally an exclusive create.
    """
    if isinstance(path, RemotePath):
        path.fs.pipe_file(path.path, data, mode="create")
        return
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())

