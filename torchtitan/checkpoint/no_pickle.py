"""Reading a checkpoint's values without unpickling anything the project wrote.

A checkpoint in a shared bucket is read by people other than its writer, and ``pickle.loads``
of a crafted blob runs code. So the project's own non-tensor states are JSON text (the LR
schedule, the RNG states, a streamed dataset's position: see ``states.py`` and
``datasets/stream_dataset.py``), and DCP's byte values (the strings and numbers of a state
dict, which DCP stores with ``torch.save``) are read with ``torch.load(weights_only=True)``,
whose unpickler builds only tensors and plain containers and calls nothing else.

DCP's own ``.metadata`` is still a pickle that DCP loads itself; see docs/object_storage.md.
"""

from __future__ import annotations

import io
import json

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem


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
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
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
