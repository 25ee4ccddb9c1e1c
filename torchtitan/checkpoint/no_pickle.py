"""Reading a checkpoint's values without unpickling anything the project wrote.

A checkpoint in a shared bucket is read by people other than its writer, and ``pickle.loads``
of a crafted blob runs code. So the project's own non-tensor states are JSON text (the LR
schedule, the RNG states, a streamed dataset's position: see ``states.py`` and
``datasets/stream_dataset.py``), and DCP's byte values (the strings and numbers of a state
dict, which DCP stores with ``torch.save``) are read with ``torch.load(weights_only=True)``,
whose unpickler builds only tensors and plain containers and calls nothing else.

DCP's own ``.metadata`` (the index of tensors, shapes and files) is a pickle, which DCP would
load with ``pickle.load``. The project reads it with ``MetadataUnpickler`` instead: it builds only
the classes DCP's metadata holds (``METADATA_GLOBALS``: DCP's metadata dataclasses, ``torch.Size``,
dtypes, layouts, paths) and refuses any other name a pickle asks for, before calling it, in one line
naming the file. ``SafeMetadataReader`` and ``SafeMetadataFsspecReader`` are DCP's local and fsspec
readers with that reader of ``.metadata``; ``store.dcp_reader`` hands them to every load.
"""

from __future__ import annotations

import importlib
import io
import json
import os
import pickle
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from torchtitan.compat import fsspec_reader_type, set_state_dict_element


class OldFormatError(ValueError):
    """A checkpoint value only pickle can read: written before states were stored as JSON."""


def old_format_line(what: str) -> str:
    return (f"{what} was written by an older version of this project as a pickle, which is not loaded (a crafted "
            "checkpoint would run code); resume without it (--checkpoint.exclude_from_loading) or start a new run")


class NoPickleLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner whose byte values are read with the restricted (weights-only) unpickler."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as e:  # noqa: BLE001 - torch raises UnpicklingError or RuntimeError alike
            raise OldFormatError(f"{old_format_line(f'checkpoint value {fqn!r}')} ({type(e).__name__})") from None
        if self.flatten_state_dict:
            set_state_dict_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def to_json(value: object) -> str:
    """A state as JSON text (DCP keeps a string as one value, where it would flatten nested dicts)."""
    return json.dumps(value, sort_keys=True)


def from_json(text: object, what: str) -> dict:
    """The state ``to_json`` wrote; an older checkpoint's pickled bytes are refused in one line."""
    if not isinstance(text, str):
        raise OldFormatError(old_format_line(what))
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"{what}: expected a JSON object, found {type(value).__name__}")
    return value


# ---- DCP's .metadata ----------------------------------------------------------------------------
# Every name a ``.metadata`` pickle of torch 2.11-2.14 refers to (and the ShardedTensor properties of
# older writers); each is a dataclass, an enum, torch.Size or a lookup by name, none of which runs code.
METADATA_GLOBALS: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.distributed._shard.sharded_tensor.metadata": frozenset({"TensorProperties", "MEM_FORMAT_ENCODING"}),
    "torch.serialization": frozenset({"_get_layout"}),  # torch.strided and the other layouts, by name
    "collections": frozenset({"OrderedDict"}),
}
# StorageMeta.checkpoint_id is the path the writer was given (Python 3.13 pickles pathlib's classes
# from pathlib._local). A Windows path is read as a pure one: it cannot be made on another system.
_PATHS = {"PosixPath": "PosixPath", "PurePosixPath": "PurePosixPath", "WindowsPath": "PureWindowsPath",
          "PureWindowsPath": "PureWindowsPath"}


class UnsafeMetadataError(BaseException):
    """A ``.metadata`` that names something DCP's metadata never holds: unpickling it could run code.

    A BaseException, like DCP's own ``CheckpointException``: DCP's load takes any ``Exception`` from
    ``read_metadata`` for a missing file and falls back to a rank's own metadata, which would bury the
    refusal under "metadata is None". ``store.read_dcp_metadata`` turns it into its ``ValueError``.
    """


def _metadata_global(module: str, name: str) -> Any:
    """The object ``module.name`` when a ``.metadata`` may refer to it, else None (nothing is imported then)."""
    if module == "torch":
        value = vars(torch).get(name)  # not getattr: torch's module __getattr__ would import what it names
        return value if name == "Size" or isinstance(value, torch.dtype) else None
    if module in ("pathlib", "pathlib._local") and name in _PATHS:
        import pathlib

        return getattr(pathlib, _PATHS[name])
    if name in METADATA_GLOBALS.get(module, ()):
        return getattr(importlib.import_module(module), name, None)
    return None


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata``, building only ``METADATA_GLOBALS``; any other name is refused before use."""

    def __init__(self, file: IO[bytes], source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        value = _metadata_global(module, name)
        if value is None:
            raise UnsafeMetadataError(
                f"{self.source} is refused: it names {module}.{name}, which DCP's metadata never holds, so unpickling "
                "it could run code (a crafted or foreign file); nothing of it was loaded or run")
        return value


def load_dcp_metadata(file: IO[bytes], source: str) -> Metadata:
    """DCP's ``Metadata`` from ``file`` (named ``source`` in errors) through ``MetadataUnpickler``."""
    metadata = MetadataUnpickler(file, source).load()
    if not isinstance(metadata, Metadata):
        raise ValueError(f"{source} holds a {type(metadata).__name__}, not DCP's metadata")
    return metadata


def _read_metadata(reader: FileSystemReader, rank: int | None) -> Metadata:
    """What DCP's ``FileSystemReader.read_metadata`` returns (torch 2.11-2.14), read with ``MetadataUnpickler``."""
    path = reader._get_metadata_path(rank)  # ``.metadata``, or a rank's own ``__<rank>.metadata``
    with reader.fs.create_stream(path, "rb") as stream:
        metadata = load_dcp_metadata(cast(IO[bytes], stream), os.fspath(path))
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    assert metadata.storage_meta is not None
    metadata.storage_meta.load_id = reader.load_id
    return metadata


class SafeMetadataReader(FileSystemReader):
    """DCP's reader of a local checkpoint folder, reading ``.metadata`` with ``MetadataUnpickler``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return _read_metadata(self, kwargs.get("rank"))


class SafeMetadataFsspecReader(fsspec_reader_type()):
    """DCP's reader of an object-store checkpoint, reading ``.metadata`` with ``MetadataUnpickler``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return _read_metadata(self, kwargs.get("rank"))
