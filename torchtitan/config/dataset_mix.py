"""One source of a weighted data mixture, as the config gives it: a TOML table or a CLI item.

In TOML a mixture is a list of tables::

    [[training.dataset_mix]]
    path = "/data/stores/web"      # a token store, or local json/jsonl/parquet/txt file or folder
    weight = 0.7
    [[training.dataset_mix]]
    dataset = "embedded"           # or a registry name (c4), or hub:<owner>/<name>[:<config>]
    weight = 0.3
    name = "docs"                  # optional: the label of logs and metrics (default: the folder's or dataset's)

A hub dataset (``c4``, ``hub:allenai/c4:en``) is prepared into a cached token store on first
use, as local files are. On the command line the whole list is one option, comma-separated
``WEIGHT:SOURCE`` items, where ``SOURCE`` is ``dataset=NAME``, ``hub:<name>[:<config>]``,
``path=PATH`` or a bare path::

    --training.dataset_mix "0.7:/data/stores/web,0.2:dataset=embedded,0.1:hub:allenai/c4:en"

Each entry is normalized to a plain dict (``path`` or ``dataset``, ``weight``, and the
optional ``name`` and ``validation_path``), which the effective config writes back as the
same TOML tables.
"""

from __future__ import annotations

import math
import os
from typing import Any

__all__ = ["CLI_FORM", "mix_source_name", "parse_mix_entry"]

_KEYS = ("path", "dataset", "weight", "name", "validation_path")
CLI_FORM = ("WEIGHT:SOURCE items, SOURCE = dataset=NAME, hub:NAME[:CONFIG], path=PATH or a bare path "
            "(e.g. 0.7:/data/web,0.2:dataset=embedded,0.1:hub:allenai/c4:en)")
_HUB = "hub:"  # the spelling of a hub dataset, as scripts/prepare_data.py takes it


def _weight(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"weight {value!r} is not a number")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"weight {value!r}: give a positive finite number")
    return float(value)


def _from_cli(item: str) -> dict[str, Any]:
    weight, sep, source = item.strip().partition(":")
    if not sep or not source.strip():
        raise ValueError(f"'{item}' is not WEIGHT:SOURCE; give {CLI_FORM}")
    try:
        number = float(weight)
    except ValueError:
        raise ValueError(f"'{item}': '{weight}' is not a weight; give {CLI_FORM}") from None
    source = source.strip()
    key, eq, rest = source.partition("=")
    if eq and key in ("dataset", "path"):
        return {key: rest.strip(), "weight": number}
    if source.startswith(_HUB):
        return {"dataset": source, "weight": number}
    return {"path": source, "weight": number}


def parse_mix_entry(value: object, from_cli: bool) -> dict[str, Any]:
    """One mixture source, normalized; ValueError naming the problem and the form to use."""
    if from_cli and isinstance(value, str):
        value = _from_cli(value)
    if not isinstance(value, dict):
        raise ValueError(f"{value!r} is not a table with path (or dataset) and weight")
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(unknown)} in a mixture source; use {', '.join(_KEYS)}")
    has_path, has_dataset = bool(value.get("path")), bool(value.get("dataset"))
    if has_path == has_dataset:
        raise ValueError(f"a mixture source needs exactly one of path or dataset, got {value!r}")
    if "weight" not in value:
        raise ValueError(f"mixture source {value!r} has no weight")
    entry: dict[str, Any] = {"path": value["path"]} if has_path else {"dataset": value["dataset"]}
    for key in ("path", "dataset", "name", "validation_path"):
        if key in value and not isinstance(value[key], str):
            raise ValueError(f"{key} {value[key]!r} of a mixture source is not a string")
    entry["weight"] = _weight(value["weight"])
    for key in ("name", "validation_path"):
        if value.get(key):
            entry[key] = value[key]
    return entry


def mix_source_name(entry: dict[str, Any]) -> str:
    """The label of a source in logs and metrics: its ``name``, else its folder's (or file's) or dataset's name
    (of ``hub:owner/name:config``, ``name``)."""
    if entry.get("name"):
        return entry["name"]
    if entry.get("path"):
        base = os.path.basename(os.path.normpath(os.path.expanduser(entry["path"])))
        return base.split(".")[0] or base or entry["path"]
    dataset = entry["dataset"]
    if dataset.startswith(_HUB):
        return dataset[len(_HUB):].partition(":")[0].rstrip("/").rsplit("/", 1)[-1] or dataset
    return dataset
