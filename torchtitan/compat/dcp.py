"""Distributed checkpointing's (``torch.distributed.checkpoint``) private fsspec storage (object stores) and
state-dict traversal: the checkpoint package subclasses the fsspec file system, writer and reader, and sets a
loaded value into a nested state dict the way DCP's default planner does.

The installed torch (docs/versions.md) keeps them in ``torch.distributed.checkpoint._fsspec_filesystem`` and
``._traverse``. They are imported when asked for: the fsspec module needs the ``fsspec`` package, which only
object-store checkpoints do.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

from torchtitan.compat.errors import missing

if TYPE_CHECKING:
    from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE

_FSSPEC = "torch.distributed.checkpoint._fsspec_filesystem"


def _module(name: str, attribute: str) -> ModuleType:
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:  # a dependency of torch's module (fsspec): its own error names it
            raise
        raise missing(f"{name}.{attribute}") from None
    if not hasattr(module, attribute):
        raise missing(f"{name}.{attribute}")
    return module


def fsspec_file_system_type() -> type[FsspecFileSystem]:
    """DCP's fsspec file system (the streams of an object-store checkpoint), to subclass."""
    return _module(_FSSPEC, "FileSystem").FileSystem


def fsspec_writer_type() -> type[FsspecWriter]:
    """DCP's writer into an object store (``FileSystemWriter`` over fsspec)."""
    return _module(_FSSPEC, "FsspecWriter").FsspecWriter


def fsspec_reader_type() -> type[FsspecReader]:
    """DCP's reader of an object-store checkpoint (``FileSystemReader`` over fsspec)."""
    return _module(_FSSPEC, "FsspecReader").FsspecReader


def set_state_dict_element(root: STATE_DICT_TYPE, path: tuple[str | int, ...], value: object) -> None:
    """Set ``value`` at ``path`` (keys and indices) of the nested ``root``, as DCP's default load planner
    does for a flattened state dict."""
    _module("torch.distributed.checkpoint._traverse", "set_element").set_element(root, path, value)
