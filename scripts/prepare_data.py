#!/usr/bin/env python
"""Tokenize a corpus into a token store folder for training.

    python scripts/prepare_data.py data/my_corpus/ /data/stores/my_corpus --workers 16
    python train.py ... --training.dataset_path /data/stores/my_corpus

Sources: a local json/jsonl/parquet/txt file or folder, ``embedded`` (the
corpus shipped with the project), or ``hub:<name>[:<config>]`` for a dataset on
the Hugging Face hub, streamed with ``datasets`` (``--hub-split`` picks the split), or
a registered hub dataset (``c4``).

The store is written atomically (``torchtitan/datasets/prepare.py``); rerunning
the same command after a kill keeps the shards already finished.  Give the run's
``--validation.held_out_fraction``/``--validation.split_seed`` here too when the
run holds documents out: they are left out of the store, and a run with other
values refuses the store. With ``--held-out-side`` the store holds only those
documents instead: the run's validation data, for ``--validation.dataset_path``.

A mixture's sources, each into a store of its own, one after the other with every core::

    python scripts/prepare_data.py --mix train.toml /data/stores

reads the ``[[training.dataset_mix]]`` tables (and the held-out split of ``[validation]``) of
the config file, prepares each source that is not a store yet into ``/data/stores/NAME`` (and
its held-out documents into ``NAME-held_out`` when the config holds some out), and prints the
tables to use instead, which name the stores.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from torchtitan.datasets.embedded_corpus import ensure_embedded_corpus  # noqa: E402
from torchtitan.datasets.prepare import DEFAULT_SHARD_CHARS, prepare_store  # noqa: E402
from torchtitan.datasets.sources import (  # noqa: E402
    hub_dataset,
    iter_hub_documents,
    iter_local_documents,
    source_files,
    source_fingerprint,
)
from torchtitan.datasets.split import HeldOutSplit  # noqa: E402
from torchtitan.datasets.tokenizer import resolve_tokenizer_path  # noqa: E402

DEFAULT_TOKENIZER = "torchtitan/datasets/assets/tokenizer.model"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Tokenize a corpus into a token store folder for training.")
    p.add_argument("source",
                   help="local file or folder (json/jsonl/parquet/txt), 'embedded', c4, or hub:<name>[:<config>]")
    p.add_argument("out", help="store folder to create (pass it to train.py as --training.dataset_path)")
    p.add_argument("--tokenizer", default=DEFAULT_TOKENIZER, help="SentencePiece tokenizer.model the run uses")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizing processes (default: all cores)")
    p.add_argument("--shard-mb", type=float, default=DEFAULT_SHARD_CHARS / 2**20,
                   help="text per shard in MiB (one shard is one unit of work and of resume)")
    p.add_argument("--held-out-fraction", type=float, default=0.0, help="the run's --validation.held_out_fraction")
    p.add_argument("--split-seed", type=int, default=0, help="the run's --validation.split_seed")
    p.add_argument("--held-out-side", action="store_true",
                   help="keep only the held-out documents (a validation store for --validation.dataset_path)")
    p.add_argument("--hub-split", default="train", help="split of a hub dataset")
    p.add_argument("--text-field", default="text", help="record field holding the document text")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--mix", action="store_true",
                   help="source is a train config TOML: prepare each [[training.dataset_mix]] source into OUT/NAME")
    return p.parse_args(argv)


def _documents(source: str, hub_split: str, text_field: str) -> tuple[Iterator[str], str, list[str]]:
    """The documents of a source, its fingerprint and its files."""
    # hub:<name>[:<config>], or a registered hub dataset (c4) that is not a local path
    hub = hub_dataset(source, hub_split) if not os.path.exists(os.path.expanduser(source)) else None
    if hub is not None:
        return iter_hub_documents(hub, text_field), hub.fingerprint, []
    if source == "embedded":
        paths = [Path(ensure_embedded_corpus())]
    else:
        paths = source_files(source)
        if not paths:
            raise SystemExit(f"{source}: no json/jsonl/parquet/txt files in it")
    return iter_local_documents(paths, text_field), source_fingerprint(paths), [str(p) for p in paths]


def _prepare(args: argparse.Namespace, source: str, out: str, tokenizer: str, split: HeldOutSplit | None,
             held_out: bool) -> Path:
    documents, fingerprint, files = _documents(source, args.hub_split, args.text_field)
    return prepare_store(
        documents=documents, out_dir=out, tokenizer_path=tokenizer,
        source={"label": source, "files": files, "fingerprint": fingerprint}, split=split,
        held_out=held_out, workers=args.workers, shard_chars=int(args.shard_mb * 2**20),
        progress=not args.no_progress,
    )


def _prepare_mixture(args: argparse.Namespace, tokenizer: str) -> Path:
    """Every source of the config's mixture into ``args.out/NAME``; prints the tables naming the stores."""
    from torchtitan.config import ConfigManager
    from torchtitan.config.dataset_mix import mix_source_name
    from torchtitan.datasets.token_store import is_store

    cfg = ConfigManager().parse_args(["--job.config_file", args.source])
    if not cfg.training.dataset_mix:
        raise SystemExit(f"{args.source}: no [[training.dataset_mix]] tables in it")
    split = HeldOutSplit.from_config(cfg.validation)
    tables = []
    for entry in cfg.training.dataset_mix:
        name, path = mix_source_name(entry), entry.get("path")
        table = {k: v for k, v in entry.items() if k not in ("path", "dataset")}
        if path and is_store(os.path.expanduser(path)):
            tables.append({"path": path, **table})
            continue
        source = path or entry["dataset"]
        table["path"] = str(_prepare(args, source, os.path.join(args.out, name), tokenizer, split, False))
        if split is not None and "validation_path" not in entry:
            held = os.path.join(args.out, f"{name}-held_out")
            table["validation_path"] = str(_prepare(args, source, held, tokenizer, split, True))
        tables.append(table)
    import tomli_w

    print(tomli_w.dumps({"training": {"dataset_mix": tables}}))
    return Path(args.out)


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    tokenizer = resolve_tokenizer_path(args.tokenizer)
    if args.mix:
        return _prepare_mixture(args, tokenizer)
    split = HeldOutSplit(args.held_out_fraction, args.split_seed) if args.held_out_fraction > 0 else None
    if args.held_out_side and split is None:
        raise SystemExit("--held-out-side keeps the documents --held-out-fraction holds out; give that fraction too")
    out = _prepare(args, args.source, args.out, tokenizer, split, args.held_out_side)
    print(out)
    return out


if __name__ == "__main__":
    sys.exit(main() and 0)
