"""Where documents come from: the dataset registry, local files and their fingerprints.

The bottom of the data chain (``sources`` -> ``token_store`` -> ``prepare`` ->
``store_cache`` -> ``window_order`` -> ``store_dataset``/``stream_dataset`` ->
``loaders``): nothing here knows about token stores beyond the error they share.

- ``DATASETS``: the named datasets (the embedded corpus, c4 on the hub).
- Hub datasets (``HubDataset``): a registered one, or ``hub:<name>[:<config>]``;
  ``iter_hub_documents`` yields their texts for preparing a store.
- Local files: a ``.json``/``.jsonl``/``.parquet``/``.txt`` file, or a folder of
  them read in sorted path order. ``iter_local_documents`` yields their texts for
  preparing a store; ``load_local_dataset`` streams them with ``datasets``.
- Fingerprints of source files and tokenizers, which name a prepared store.

Malformed input stops reading with ``file:line`` in the message: skipping a line
silently would change the data the run trains on.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from torchtitan.datasets.embedded_corpus import ensure_embedded_corpus

__all__ = [
    "DATASETS",
    "DatasetSpec",
    "HubDataset",
    "SourceSpec",
    "TokenStoreError",
    "file_fingerprint",
    "hub_dataset",
    "iter_hub_documents",
    "iter_local_documents",
    "load_local_dataset",
    "open_source",
    "source_files",
    "source_fingerprint",
    "tokenizer_fingerprint",
]


class TokenStoreError(ValueError):
    """A token store or its source cannot be used; the message names the folder or file and the fix."""


# ------------------------------------------------------------------ the registry


@dataclass(frozen=True)
class HubDataset:
    """A dataset on the Hugging Face hub: its repository, config and split."""

    name: str
    config: str | None = None
    split: str = "train"

    def load(self) -> Iterable[dict[str, object]]:
        """Its records, streamed (needs network access to the hub, or a populated HF cache)."""
        import datasets

        return datasets.load_dataset(self.name, name=self.config, split=self.split, streaming=True)

    @property
    def fingerprint(self) -> str:
        """What names its prepared store: the hub's data is not hashed (it would mean reading all of it)."""
        return hashlib.sha256(f"{self.name}:{self.config or ''}:{self.split}".encode()).hexdigest()

    @property
    def label(self) -> str:
        """A folder-safe short name: the repository's last part, and the config."""
        base = self.name.rstrip("/").rsplit("/", 1)[-1] or "hub"
        return f"{base}-{self.config}" if self.config else base


@dataclass(frozen=True)
class DatasetSpec:
    """How to open a named dataset.

    ``load`` returns an iterable of records (re-iterable: every ``iter()``
    starts again from the first record); ``text_field`` names the record key
    holding the document text; ``hub`` is where a hub dataset lives.
    """

    load: Callable[[], Iterable[dict[str, object]]]
    text_field: str = "text"
    description: str = ""
    hub: HubDataset | None = None


# `datasets` is imported inside the loaders: it takes about a second to
# import, and code that only needs the tokenizer should not pay for it.


def _load_embedded() -> Iterable[dict[str, object]]:
    # Training reads the embedded corpus from a token store; this streamed form is
    # for comparisons with a packing baseline (benchmarks/data.py).
    import datasets

    return datasets.load_dataset("json", data_files=ensure_embedded_corpus(), split="train", streaming=True)


_C4 = HubDataset("allenai/c4", "en", "train")
_C4_VALIDATION = HubDataset("allenai/c4", "en", "validation")

DATASETS: dict[str, DatasetSpec] = {
    "embedded": DatasetSpec(
        load=_load_embedded,
        description="CPython documentation shipped with Python (offline default, ~1.4 MB)",
    ),
    "c4": DatasetSpec(
        load=_C4.load, hub=_C4,
        description="allenai/c4 'en' train split, streamed from the Hugging Face hub",
    ),
    "c4_validation": DatasetSpec(
        load=_C4_VALIDATION.load, hub=_C4_VALIDATION,
        description="allenai/c4 'en' validation split, streamed from the Hugging Face hub",
    ),
}

HUB_PREFIX = "hub:"


def hub_dataset(source: str, split: str = "train") -> HubDataset | None:
    """The hub dataset ``source`` names: ``hub:<name>[:<config>]`` (of ``split``) or a registered hub dataset."""
    if source.startswith(HUB_PREFIX):
        name, _, config = source[len(HUB_PREFIX):].partition(":")
        if not name:
            raise ValueError(f"{source!r} names no hub dataset; write hub:<owner>/<name>[:<config>]")
        return HubDataset(name, config or None, split)
    spec = DATASETS.get(source)
    return spec.hub if spec is not None else None


def iter_hub_documents(hub: HubDataset, text_field: str = "text") -> Iterator[str]:
    """Document texts of a hub dataset in its order (records without text skipped: they add no tokens)."""
    for record in hub.load():
        text = record.get(text_field)
        if isinstance(text, str) and text:
            yield text


# ------------------------------------------------------------------ local files

# The supported local file suffixes, and the `datasets` packaged builder of each.
_BUILDER_BY_SUFFIX: dict[str, str] = {
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".txt": "text",
}
_KNOWN_SUFFIXES = ", ".join(sorted(_BUILDER_BY_SUFFIX))


def _builder_for(path: Path) -> str | None:
    return _BUILDER_BY_SUFFIX.get(path.suffix.lower())


def source_files(path: str) -> list[Path]:
    """The local files a dataset path names: the file, or the supported files of a folder in sorted order."""
    root = Path(os.path.expanduser(path))
    if not root.exists():
        raise FileNotFoundError(f"dataset_path {path!r} does not exist")
    if root.is_file():
        return [root]
    return sorted(p for p in root.rglob("*") if p.is_file() and _builder_for(p) is not None)


def _builder_of(path: str, files: list[Path]) -> str:
    """The one `datasets` builder that reads every file of ``path``, or the error saying why there is none."""
    if Path(os.path.expanduser(path)).is_dir():
        if not files:
            raise ValueError(f"dataset_path {path!r} is a directory without any {_KNOWN_SUFFIXES} files")
        builders = {b for p in files if (b := _builder_for(p)) is not None}  # every file has one (see above)
        if len(builders) > 1:
            raise ValueError(
                f"dataset_path {path!r} mixes file formats ({', '.join(sorted(builders))}); "
                "put each format in its own directory"
            )
        return builders.pop()
    builder = _builder_for(files[0])
    if builder is None:
        raise ValueError(f"dataset_path {path!r} has an unsupported suffix; expected one of {_KNOWN_SUFFIXES}")
    return builder


def load_local_dataset(path: str) -> Iterable[dict[str, object]]:
    """Stream a local ``.json``/``.jsonl``/``.parquet``/``.txt`` file, or a directory of them.

    Records must have a "text" field (JSON and Parquet); plain-text files are
    split into documents at blank lines (``sample_by="paragraph"``).  Files in
    a directory are read in sorted path order, and all of them must share one
    format.
    """
    import datasets

    files = source_files(path)
    builder = _builder_of(path, files)
    data_files = [str(p) for p in files]
    if builder == "text":  # documents split at blank lines
        return datasets.load_dataset(builder, data_files=data_files, split="train", streaming=True,
                                     sample_by="paragraph")
    return datasets.load_dataset(builder, data_files=data_files, split="train", streaming=True)


def open_source(dataset_name: str, dataset_path: str | None) -> tuple[Iterable[dict[str, object]], str]:
    """Return (records, text_field) for the configured dataset, streamed."""
    if dataset_path:
        # An explicit path wins; the name then only labels the data in logs.
        return load_local_dataset(dataset_path), "text"
    spec = DATASETS.get(dataset_name)
    if spec is None:
        known = ", ".join(sorted(DATASETS))
        raise ValueError(
            f"Unknown dataset {dataset_name!r}. Known datasets: {known}; "
            "or set dataset_path to a local .json/.jsonl/.parquet/.txt file or directory."
        )
    return spec.load(), spec.text_field


# ------------------------------------------------------------- document texts


def _record_text(record: object, text_field: str, where: str) -> str:
    if not isinstance(record, dict) or text_field not in record:
        fields = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise TokenStoreError(f"{where}: record has no {text_field!r} field (fields: {fields})")
    text = record[text_field]
    if text is not None and not isinstance(text, str):
        raise TokenStoreError(f"{where}: field {text_field!r} is {type(text).__name__}, not text")
    return text or ""


def _iter_json(path: Path, text_field: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        head = f.read(1)
        while head.isspace():
            head = f.read(1)
        f.seek(0)
        if head == "[":  # one JSON array of records
            try:
                records = json.load(f)
            except json.JSONDecodeError as e:
                raise TokenStoreError(f"{path}:{e.lineno}: malformed JSON ({e.msg}); fix or remove it") from None
            for number, record in enumerate(records):
                yield _record_text(record, text_field, f"{path}[{number}]")
            return
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise TokenStoreError(
                    f"{path}:{lineno}: malformed JSON line ({e.msg}); preparation stops rather than train on "
                    "silently changed data: fix or remove the line and rerun (finished shards are kept)"
                ) from None
            yield _record_text(record, text_field, f"{path}:{lineno}")


def _iter_with_datasets(path: Path, text_field: str) -> Iterator[str]:
    # Parquet and plain text read exactly as the streamed source (``load_local_dataset``) reads them.
    for number, record in enumerate(load_local_dataset(str(path))):
        yield _record_text(record, text_field, f"{path} record {number}")


def iter_local_documents(files: Iterable[Path], text_field: str = "text") -> Iterator[str]:
    """Document texts of local files in order (empty documents skipped: they add no tokens)."""
    for path in files:
        reader = _iter_json if _builder_for(path) == "json" else _iter_with_datasets
        for text in reader(path, text_field):
            if text:
                yield text


@dataclass(frozen=True)
class SourceSpec:
    """What to prepare: a label for folder names, a fingerprint, and where the documents are (files or the hub)."""

    label: str
    fingerprint: str
    files: tuple[Path, ...]
    text_field: str = "text"
    hub: HubDataset | None = None

    @classmethod
    def of_hub(cls, hub: HubDataset, text_field: str = "text") -> SourceSpec:
        return cls(label=hub.label, fingerprint=hub.fingerprint, files=(), text_field=text_field, hub=hub)

    def documents(self) -> Iterator[str]:
        if self.hub is not None:
            return iter_hub_documents(self.hub, self.text_field)
        return iter_local_documents(self.files, self.text_field)


# ----------------------------------------------------------------- fingerprints


def file_fingerprint(path: str | os.PathLike, *, full: bool = True) -> str:
    """sha256 of a file's bytes; with ``full=False`` only of its size, head and tail (cheap for huge files)."""
    h = hashlib.sha256()
    p = Path(path)
    size = p.stat().st_size
    with open(p, "rb") as f:
        if full or size <= 4 << 20:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        else:
            h.update(str(size).encode())
            h.update(f.read(1 << 20))
            f.seek(size - (1 << 20))
            h.update(f.read(1 << 20))
    return h.hexdigest()


def tokenizer_fingerprint(path: str | os.PathLike) -> str:
    """sha256 of the tokenizer: its file, or a Hugging Face folder's tokenizer.json and tokenizer_config.json."""
    p = Path(path)
    if p.is_file():
        return file_fingerprint(p)
    h = hashlib.sha256()
    for f in (p / "tokenizer.json", p / "tokenizer_config.json"):
        if f.is_file():
            h.update(f.name.encode() + b"\0" + file_fingerprint(f).encode())
    return h.hexdigest()


def source_fingerprint(files: list[Path]) -> str:
    """Names, sizes and (head/tail) contents of the source files: any edit gives another store."""
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode() + b"\0" + file_fingerprint(p, full=False).encode())
    return h.hexdigest()
