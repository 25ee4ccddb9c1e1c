"""The run's data loaders: training batches, validation batches, and the data checks preflight runs.

The top of the data chain: it picks the source (``sources``), opens or prepares
its token store (``token_store``, ``store_cache``) and deals it out
(``store_dataset``), or streams a hub dataset per DP rank (``stream_dataset``).

Data flow
---------
1. A *document source* yields records (dicts) in a fixed order: a registered
   dataset (``DATASETS``) or a local file/directory given as ``dataset_path``.
2. Every document is encoded with BOS and EOS and appended to one token
   stream.  The stream is cut into consecutive, non-overlapping windows of
   ``seq_len + 1`` tokens; window ``i`` is global sample ``i`` with
   ``inputs = window[:-1]`` and ``labels = window[1:]``.  Tokens left over at
   the end of the data (less than one window) are dropped.  With a held-out
   split (``split.py``) the documents it holds out for validation are left out
   of the training stream before anything else happens.  For document-masked
   attention a batch also carries each input token's position within its
   document, derived from the BOS tokens (``documents.py``).
3. Samples are dealt out to data-parallel ranks in blocks.  With local batch
   ``B`` and DP degree ``D`` the global batch ``s`` is windows
   ``[s*B*D, (s+1)*B*D)`` and DP rank ``r`` receives the contiguous block
   ``[s*B*D + r*B, s*B*D + (r+1)*B)``.  The stream itself never depends on
   ``D``, so a run with ``D=1`` and batch ``B*D`` sees exactly the same global
   batches, and so does a run that accumulates gradients over several
   consecutive local batches.

Training and validation read this stream from a token store (``token_store.py``,
``store_dataset.py``): the embedded corpus and local files are tokenized once
into memory-mapped shards, on first use, and every rank reads only its own
windows by index.  A single hub dataset (``c4``) is streamed per DP rank instead
(``stream_dataset.py``), which gives up the DP-degree-independent order; in a
mixture it is prepared into a cached store like local files.

End of data
-----------
A global batch is handed out only once all of its ``B*D`` windows exist, so
the last, incomplete global batch of a pass is dropped on every rank alike
and no rank ever waits for a batch that its peers do not produce.  (The
number of complete global batches depends only on ``B*D``; a run that
accumulates gradients with a smaller ``B*D`` may therefore keep a few more
windows at the end of an epoch than a run without accumulation.)  With
``infinite=True`` the data is then re-read from the beginning (epoch + 1);
otherwise iteration stops.

Mixtures
--------
``training.dataset_mix`` names several sources with weights instead. Each is opened as a
token store like ``dataset_path`` (``open_mixture_sources``); a hub dataset too is prepared
into a cached store on first use rather than streamed, and ``mixture.py`` deals out one
global stream of their windows in the interleave's exact proportions, with the same
dealing to DP ranks as above; validation then reads each source's held-out part
(``build_mixture_validation``).

Checkpointing
-------------
The loader's ``state_dict()`` stores a position that does not depend on the DP
degree: the epoch and the index of the first window of the next global batch
(with the seq_len and the held-out split's key, which the window numbers depend on).
Loading it into a loader with another DP degree (or local batch size)
continues the same global sample stream from that window, in constant time.

Concurrency
-----------
Every rank opens the same token store. The first process to need a cached
store prepares it under a file lock while the others wait (``store_cache``);
once finished, a store is read-only, and each rank memory-maps only the shards
its windows fall in, so any number of ranks read it at once without
coordination. Hub datasets are read with ``datasets`` (``streaming=True``), which
writes no Arrow cache that ranks could race on; a mixture's hub source is read only
by the process that prepares its store.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

import torch
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan.config.dataset_mix import mix_source_name
from torchtitan.datasets.embedded_corpus import default_cache_dir, ensure_embedded_corpus
from torchtitan.datasets.layout import DataLayout
from torchtitan.datasets.mixture import MixSource, MixtureDataset
from torchtitan.datasets.sources import (
    DATASETS,
    SourceSpec,
    hub_dataset,
    load_local_dataset,
    open_source,
    source_files,
    source_fingerprint,
)
from torchtitan.datasets.split import HeldOutSplit
from torchtitan.datasets.store_cache import ensure_store
from torchtitan.datasets.store_dataset import TokenStoreDataset
from torchtitan.datasets.stream_dataset import ShardedStreamDataset
from torchtitan.datasets.token_store import TokenStore, is_store, looks_like_store
from torchtitan.datasets.tokenizer import Tokenizer

__all__ = [
    "build_dataloader",
    "build_mixture_validation",
    "open_mixture_sources",
    "build_validation_dataset",
    "check_training_data",
    "document_bos",
    "open_token_store",
    "open_validation_store",
]

logger = logging.getLogger(__name__)


def _store_source(dataset_name: str, dataset_path: str | None, hub: bool = False) -> SourceSpec | None:
    """What to prepare into a token store, or None for a hub dataset (streamed, sharded by document), unless
    ``hub`` asks for a hub dataset's store too."""
    if dataset_path:
        files = source_files(dataset_path)
        if not files:
            load_local_dataset(dataset_path)  # raises the error naming what the folder lacks
        label = Path(os.path.expanduser(dataset_path)).name.split(".")[0] or "data"
        return SourceSpec(label=label, fingerprint=source_fingerprint(files), files=tuple(files))
    if dataset_name == "embedded":
        corpus = Path(ensure_embedded_corpus())
        return SourceSpec(label="embedded", fingerprint=source_fingerprint([corpus]), files=(corpus,))
    found = hub_dataset(dataset_name) if hub else None
    return SourceSpec.of_hub(found) if found is not None else None


def open_token_store(
    *, dataset_name: str, dataset_path: str | None, tokenizer: Tokenizer, split: HeldOutSplit | None,
    held_out: bool = False, cache_dir: str | None = None, prepare_workers: int = 1, any_split: bool = False,
    hub: bool = False,
) -> TokenStore | None:
    """The token store this run reads: the store at ``dataset_path``, or one prepared on first use in the cache.

    With ``split`` the store holds the documents it does not hold out, or with
    ``held_out`` only those it does. ``any_split`` accepts a prepared store whatever
    split it was made with (a validation set of its own). None for hub datasets,
    which are streamed (see ``build_dataloader``), unless ``hub`` asks to prepare them
    too: ``dataset_name`` is then also ``hub:<name>[:<config>]``, whose train split
    is prepared (a mixture's source).
    """
    if dataset_path and is_store(os.path.expanduser(dataset_path)):
        store = TokenStore(os.path.expanduser(dataset_path))
        store.check_tokenizer(tokenizer.model_path, tokenizer.n_words)
        if not any_split:
            store.check_split(split)
        return store
    if dataset_path and looks_like_store(Path(os.path.expanduser(dataset_path))):
        TokenStore(os.path.expanduser(dataset_path))  # raises: no index
    if not dataset_path and dataset_name not in DATASETS and not (hub and hub_dataset(dataset_name)):
        open_source(dataset_name, dataset_path)  # raises the unknown-dataset error
    spec = _store_source(dataset_name, dataset_path, hub)
    if spec is None:
        return None
    path = ensure_store(spec, tokenizer_path=tokenizer.model_path, split=split, held_out=held_out,
                        cache_dir=cache_dir or default_cache_dir(), workers=prepare_workers)
    return TokenStore(path)


def document_bos(store: TokenStore) -> int:
    """The BOS id that starts each document of ``store``: what its windows' positions are derived from."""
    bos = store.index.get("bos_id")
    if not isinstance(bos, int) or bos < 0:
        raise ValueError(
            f"token store {store.path} records no BOS token, so its document boundaries are unknown and "
            "--model.attn_mask_type=block_causal cannot mask documents; prepare the store again with "
            "scripts/prepare_data.py (every document then starts with BOS), or train with "
            "--model.attn_mask_type=causal"
        )
    return bos


def check_training_data(
    *, dataset_name: str, dataset_path: str | None, tokenizer: Tokenizer, split: HeldOutSplit | None, seq_len: int,
    global_batch: int, positions: bool = False, mix: list[dict] | None = None,
) -> list[str]:
    """Problems with the training data's token store, found before any process group exists.

    Opens (on first use: prepares, under the cache lock) the store, so a store made with
    another tokenizer or split, a truncated shard, a missing index or too little data
    stops every rank alike with the folder named.  Hub datasets are not checked here.
    With ``mix`` every source of the mixture is checked (each needs one window).
    """
    if mix:
        return _check_mixture(mix, tokenizer, split, seq_len, positions)
    what = f"--training.dataset_path={dataset_path}" if dataset_path else f"--training.dataset={dataset_name}"
    try:
        store = open_token_store(dataset_name=dataset_name, dataset_path=dataset_path, tokenizer=tokenizer,
                                 split=split)
        if store is not None:
            store.check_fits(seq_len, global_batch)
            if positions:
                document_bos(store)
    except (OSError, ValueError) as e:  # TokenStoreError is a ValueError; TimeoutError an OSError
        return [f"{what}: {e}"]
    return []


def _source_what(entry: dict) -> str:
    return f"--training.dataset_mix source {mix_source_name(entry)} ({entry.get('path') or entry.get('dataset')})"


def open_mixture_sources(mix: list[dict], *, tokenizer: Tokenizer, split: HeldOutSplit | None,
                         cache_dir: str | None = None) -> list[MixSource]:
    """Each source's token store, with its weight.

    Local files, the embedded corpus and hub datasets are prepared into a cached store on
    first use (by the first process, under the cache's lock): a hub dataset is not streamed
    here, so that the mixture's order depends only on the stores' contents, in every layout.
    """
    sources = []
    for entry in mix:
        try:
            store = open_token_store(dataset_name=entry.get("dataset", ""), dataset_path=entry.get("path"),
                                     tokenizer=tokenizer, split=split, cache_dir=cache_dir, hub=True)
        except (OSError, ValueError) as e:
            raise type(e)(f"{_source_what(entry)}: {e}") from None
        if store is None:  # every dataset prepares (hub=True); kept for the type
            raise ValueError(f"{_source_what(entry)}: has no token store; give a store, local files or a hub dataset")
        sources.append(MixSource(mix_source_name(entry), float(entry["weight"]), store))
    return sources


def _check_mixture(mix: list[dict], tokenizer: Tokenizer, split: HeldOutSplit | None, seq_len: int,
                   positions: bool) -> list[str]:
    names = [mix_source_name(e) for e in mix]
    if len(set(names)) != len(names):
        return [f"--training.dataset_mix: two sources share a name ({', '.join(names)}); give each table a distinct "
                "name = \"...\""]
    problems = []
    for entry in mix:
        try:
            (source,) = open_mixture_sources([entry], tokenizer=tokenizer, split=split)
            source.store.check_fits(seq_len, 1)
            if positions:
                document_bos(source.store)
        except (OSError, ValueError) as e:
            problems.append(str(e) if str(e).startswith("--training") else f"{_source_what(entry)}: {e}")
    return problems


def build_dataloader(
    *,
    dataset_name: str,
    dataset_path: str | None,
    tokenizer: Tokenizer,
    layout: DataLayout,
    infinite: bool = True,
    split: HeldOutSplit | None = None,
    shuffle: bool = True,
    seed: int = 0,
    prefetch: int = 2,
    cache_dir: str | None = None,
    positions: bool = False,
    mix: list[dict] | None = None,
    new_phase: bool = False,
) -> StatefulDataLoader:
    """Build this DP rank's loader (``layout``) of ``(inputs, labels)`` batches, each
    ``[layout.local_batch_size, layout.seq_len]``.

    ``dataset_path``, when set, overrides ``dataset_name``: a prepared token
    store (``scripts/prepare_data.py``), or local files that are prepared into a
    store in ``cache_dir`` (default ``default_cache_dir()``) on first use, as is
    the embedded corpus.  Such a loader reads only this rank's windows, in the
    seeded order ``shuffle``/``seed`` give, with ``prefetch`` batches read ahead
    on a thread.  Its ``state_dict()`` holds the dataset position and can be
    loaded with a different ``dp_degree``.  ``split``, when set, keeps back the
    documents it holds out for validation.

    Hub datasets (``c4``) are streamed instead, each DP rank reading its own
    documents: their order depends on the DP degree (see ``stream_dataset.py``).

    ``positions``: yield ``(inputs, labels, positions)``, each input's position within its
    document (``documents.py``), which document-masked attention needs.

    ``mix`` (``training.dataset_mix`` entries), when given, replaces the dataset: a weighted
    mixture of token stores (``mixture.py``); ``new_phase`` lets a resume change it.
    """
    if mix:
        sources = open_mixture_sources(mix, tokenizer=tokenizer, split=split, cache_dir=cache_dir)
        mixture = MixtureDataset(
            sources=sources, layout=layout, shuffle=shuffle, seed=seed, prefetch=prefetch, new_phase=new_phase,
            positions_bos=document_bos(sources[0].store) if positions else None)
        if layout.dp_rank == 0:
            logger.info("Training data: %s, %s windows per source", mixture.name,
                        "/".join(f"{n:,}" for n in mixture.n_windows))
        return _loader(mixture)
    store = open_token_store(dataset_name=dataset_name, dataset_path=dataset_path, tokenizer=tokenizer, split=split,
                             cache_dir=cache_dir)
    name = dataset_path or dataset_name
    if store is not None:
        dataset: IterableDataset = TokenStoreDataset(
            store=store, layout=layout, infinite=infinite, shuffle=shuffle, seed=seed, prefetch=prefetch, name=name,
            positions_bos=document_bos(store) if positions else None,
        )
        # The dataset yields whole batches, and reads them ahead itself.
        return _loader(dataset)
    # A hub dataset: streamed, each DP rank reading its own documents (the order then depends on D).
    source, text_field = open_source(dataset_name, dataset_path)
    logger.info("%s: streamed per DP rank (no token store): the sample order depends on the DP degree %d",
                name, layout.dp_degree)
    dataset = ShardedStreamDataset(
        source=source, text_field=text_field, tokenizer=tokenizer, layout=layout, infinite=infinite, name=name,
        split=split, positions=positions,
    )
    return _loader(dataset)


def open_validation_store(
    *, dataset_name: str | None, dataset_path: str | None, train_dataset_name: str, train_dataset_path: str | None,
    split: HeldOutSplit | None, tokenizer: Tokenizer, cache_dir: str | None = None,
) -> TokenStore | None:
    """The token store of the validation data; None when it is streamed from the hub.

    The data is the named or local validation dataset, or else the documents ``split``
    holds out of the training dataset, prepared (once, cached) into a store of their own.
    """
    if dataset_name is not None or dataset_path is not None:
        store = open_token_store(dataset_name=dataset_name or "", dataset_path=dataset_path, tokenizer=tokenizer,
                                 split=None, cache_dir=cache_dir, any_split=True)
        if store is not None:
            store.check_held_out_side(split)
        return store
    if split is None:
        raise ValueError("validation needs a dataset or a held-out split of the training data")
    if train_dataset_path and is_store(os.path.expanduser(train_dataset_path)):
        raise ValueError(
            f"--training.dataset_path={train_dataset_path} is a prepared token store, and the documents held out "
            "for validation were left out of it; prepare them into a store of their own with scripts/prepare_data.py "
            f"SOURCE OUT --held-out-fraction {split.fraction} --split-seed {split.seed} --held-out-side, and pass "
            "OUT as --validation.dataset_path (keeping --validation.held_out_fraction for the training store)"
        )
    return open_token_store(dataset_name=train_dataset_name, dataset_path=train_dataset_path, tokenizer=tokenizer,
                            split=split, held_out=True, cache_dir=cache_dir)


def build_validation_dataset(
    *,
    dataset_name: str | None,
    dataset_path: str | None,
    train_dataset_name: str,
    train_dataset_path: str | None,
    split: HeldOutSplit | None,
    tokenizer: Tokenizer,
    layout: DataLayout,
    cache_dir: str | None = None,
    positions: bool = False,
) -> TokenStoreDataset | ShardedStreamDataset:
    """This DP rank's share of the validation data, in local batches; ``rewind()`` starts a pass again.

    From a token store (``open_validation_store``): one pass in window order, global
    batches dealt out as in training, so every layout evaluates the same windows; the
    last incomplete global batch is dropped on every rank alike, so all ranks run out
    together. From the hub: each DP rank streams its own documents, endlessly, so the
    ranks never run out at different batches; an evaluation then needs a number of
    batches (``validation.steps``), which preflight asks for.
    """
    store = open_validation_store(dataset_name=dataset_name, dataset_path=dataset_path,
                                  train_dataset_name=train_dataset_name, train_dataset_path=train_dataset_path,
                                  split=split, tokenizer=tokenizer, cache_dir=cache_dir)
    own = dataset_name is not None or dataset_path is not None
    if own:
        name = f"validation:{dataset_path or dataset_name}"
    else:
        assert split is not None, "open_validation_store raises without a dataset or a held-out split"
        name = f"validation:held-out {split.fraction:g} of {train_dataset_path or train_dataset_name}"
    if store is not None:
        # No read-ahead thread: an evaluation may stop after validation.steps batches.
        return TokenStoreDataset(store=store, layout=layout, infinite=False, shuffle=False, prefetch=0, name=name,
                                 positions_bos=document_bos(store) if positions else None)
    if own:
        source, text_field = open_source(dataset_name or "", dataset_path)
    else:
        source, text_field = open_source(train_dataset_name, train_dataset_path)
    return ShardedStreamDataset(
        source=source, text_field=text_field, tokenizer=tokenizer, layout=layout, infinite=True, name=name,
        split=None if own else split,
        held_out=not own, positions=positions,
    )


def build_mixture_validation(
    mix: list[dict], *, split: HeldOutSplit | None, tokenizer: Tokenizer, layout: DataLayout,
    cache_dir: str | None = None, positions: bool = False,
) -> dict[str, TokenStoreDataset]:
    """Each mixture source's held-out part, by source name: its ``validation_path``, else (a source prepared on
    first use) the documents ``split`` holds out of it. A prepared store without a ``validation_path`` has none."""
    parts: dict[str, TokenStoreDataset] = {}
    for entry in mix:
        path = entry.get("path")
        if entry.get("validation_path"):
            store = open_token_store(dataset_name="", dataset_path=entry["validation_path"], tokenizer=tokenizer,
                                     split=None, cache_dir=cache_dir, any_split=True)
        elif split is not None and not (path and is_store(os.path.expanduser(path))):
            store = open_token_store(dataset_name=entry.get("dataset", ""), dataset_path=path, tokenizer=tokenizer,
                                     split=split, held_out=True, cache_dir=cache_dir, hub=True)
        else:
            continue
        if store is None:
            continue  # not reached: every mixture source prepares a store (hub=True)
        name = mix_source_name(entry)
        parts[name] = TokenStoreDataset(
            store=store, layout=layout, infinite=False, shuffle=False, prefetch=0, name=f"validation:{name}",
            positions_bos=document_bos(store) if positions else None)
    return parts


def _loader(dataset: IterableDataset) -> StatefulDataLoader:
    """The resumable loader around a dataset that yields whole batches and reads them ahead itself."""
    with warnings.catch_warnings():
        # torchdata 0.11 calls torch.set_vital, which torch 2.13 deprecated: the warning it prints
        # at every loader says nothing a user can act on.
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        return StatefulDataLoader(dataset, batch_size=None, num_workers=0, generator=torch.Generator())
