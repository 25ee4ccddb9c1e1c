"""A weighted mixture of token stores, read as one sample stream that any layout shares and resumes.

The stream. Global sample slot ``n`` of a phase (see below) comes from the source the
interleave (``interleave.py``) gives it: every source stays within one window of its
weight's share at every slot. Source ``i``'s ``c``-th sample of the phase is its store's
window ``order_e(c mod N_i)`` in epoch ``e = c div N_i`` (``N_i``: the store's windows):
a seeded permutation (``window_order``) keyed by ``training.shuffle_seed``, the source's
place in the mixture, the phase's first slot and the epoch. A source that runs out
therefore starts a new seeded epoch of itself (logged), while the others go on; nothing
is dropped at epoch ends, so the stream does not depend on the global batch either.

Global batch ``s`` is slots ``[s*B*D, (s+1)*B*D)`` and DP rank ``r`` reads slots
``[s*B*D + r*B, ...)``, as for one store (``loaders.py``). A rank computes the source and
sample number of its own slots only (the interleave's period, held as a table, makes that
arithmetic) and reads only its own windows, so its cost does not grow with the DP degree.
The order is thus a pure function of the seed, the mixture, the stores' contents and the
phase's first slot, the same in every data-parallel layout.

Checkpoint. The position is the phase's first slot and how many samples each source gave
in it (plus the tokens each gave in earlier phases, for the metrics): the interleave's
whole state, so a resume at any DP degree costs O(1). The mixture itself (names and
weights) is saved too: a resume with another mixture is refused, unless
``training.dataset_mix_new_phase`` asks for a new phase, which then starts at the resumed
slot with fresh counts. A checkpoint of a single dataset can start a mixture phase the
same way; the trainer then gives the slot (``start_at``), since that position does not
hold it.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import Stateful

from torchtitan.config.manager import ConfigError
from torchtitan.datasets.documents import document_positions
from torchtitan.datasets.interleave import Interleave
from torchtitan.datasets.layout import DataLayout
from torchtitan.datasets.store_dataset import check_position_maps, read_ahead
from torchtitan.datasets.token_store import TokenStore
from torchtitan.datasets.window_order import WindowPermutation

__all__ = ["MixSource", "MixtureDataset", "mixture_metrics", "start_data_at"]

logger = logging.getLogger(__name__)

NEW_PHASE_OPTION = "--training.dataset_mix_new_phase"


@dataclass(frozen=True)
class MixSource:
    """One source of the mixture: its label in logs and metrics, its weight and its prepared store."""

    name: str
    weight: float
    store: TokenStore


def _describe(mixture: Sequence[tuple[str, float]]) -> str:
    return ", ".join(f"{name}:{weight:g}" for name, weight in mixture)


def _source_seed(seed: int, index: int, phase_start: int) -> int:
    digest = hashlib.blake2b(f"mix:{seed}:{index}:{phase_start}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class MixtureDataset(IterableDataset, Stateful):
    """Yields ``(inputs, labels[, positions])`` local batches ``[layout.local_batch_size, layout.seq_len]`` of the
    mixture."""

    def __init__(self, *, sources: Sequence[MixSource], layout: DataLayout, shuffle: bool = True, seed: int = 0,
                 prefetch: int = 2, positions_bos: int | None = None, new_phase: bool = False) -> None:
        names = [s.name for s in sources]
        if len(set(names)) != len(names):
            raise ValueError(f"dataset_mix: two sources are named alike ({', '.join(names)}); give each table a "
                             "distinct name = \"...\"")
        self.sources = list(sources)
        self.interleave = Interleave([s.weight for s in sources])
        self.layout = layout
        seq_len = layout.seq_len
        self.shuffle, self.seed, self.prefetch = shuffle, seed, prefetch
        self.positions_bos, self.new_phase = positions_bos, new_phase
        self.name = "mix(" + _describe(self.mixture) + ")"
        self.n_windows = []
        for s in sources:
            try:
                s.store.check_fits(seq_len, 1)
            except ValueError as e:
                raise type(e)(f"dataset_mix source {s.name}: {e}") from None
            self.n_windows.append(s.store.n_tokens // (seq_len + 1))
        splits = {s.store.split_key for s in sources}
        self.split = splits.pop() if len(splits) == 1 else None  # one split for all (checked by the builder)
        self._phase_start: int | None = 0  # the slot this phase began at; None: the trainer gives it
        self._taken = [0] * len(sources)  # samples each source gave in this phase
        self._tokens_before = [0] * len(sources)  # tokens each gave in earlier phases
        self._orders: dict[tuple[int, int, int], WindowPermutation] = {}  # read on the prefetch thread only

    @property
    def mixture(self) -> list[tuple[str, float]]:
        return [(s.name, s.weight) for s in self.sources]

    # ---------------------------------------------------------------- data

    def _window(self, source: int, number: int, phase_start: int) -> int:
        """Store window of source ``source``'s sample ``number`` of the phase."""
        epoch, index = divmod(number, self.n_windows[source])
        if not self.shuffle:
            return index
        key = (source, epoch, phase_start)
        order = self._orders.get(key)
        if order is None:
            if len(self._orders) > 4 * len(self.sources):  # only the current epochs are ever asked for again
                self._orders.clear()
            order = self._orders[key] = WindowPermutation(
                self.n_windows[source], _source_seed(self.seed, source, phase_start), epoch)
        return order.at(index)

    def _batch(self, slots: list[tuple[int, int]], phase_start: int) -> tuple[torch.Tensor, ...]:
        width = self.layout.seq_len + 1
        rows = np.stack([self.sources[i].store.read(self._window(i, c, phase_start) * width, width)
                         for i, c in slots])
        tokens = torch.from_numpy(rows)
        inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        if self.positions_bos is None:
            return inputs, labels
        return inputs, labels, document_positions(inputs, self.positions_bos)

    def _produce(self, taken: list[int], phase_start: int) -> Iterator[tuple[tuple[int, ...], tuple]]:
        """(counts after the batch, this rank's batch), one global batch after another, endlessly."""
        local, global_batch = self.layout.local_batch_size, self.layout.global_batch_size
        slot = sum(taken)
        before = list(taken)
        while True:
            after = self.interleave.counts_at(slot + global_batch)
            self._log_new_epochs(before, after)
            mine = self.interleave.slots(slot + self.layout.first_row, local)
            yield tuple(after), self._batch(mine, phase_start)
            slot, before = slot + global_batch, after

    def _log_new_epochs(self, before: list[int], after: list[int]) -> None:
        """Say which sources ran out in this global batch: a sample number in [before, after) starts an epoch."""
        for i, (b, a) in enumerate(zip(before, after)):
            n = self.n_windows[i]
            first = max(1, -(-b // n)) * n  # the first positive multiple of n at or after b
            for c in range(first, a, n):
                logger.info("%s: source %s ran out after %d windows; starting its epoch %d (seeded)",
                            self.name, self.sources[i].name, n, c // n)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        if self._phase_start is None:
            raise RuntimeError(f"{self.name}: a new phase after a single-dataset checkpoint needs its first slot: "
                               "call start_at(samples) before iterating")
        produced = self._produce(self._taken, self._phase_start)
        items, prefetcher = (produced, None) if self.prefetch <= 0 else read_ahead(produced, self.prefetch, self.name)
        try:
            for counts, batch in items:
                self._taken = list(counts)  # before yielding: the consumer may checkpoint while we are suspended
                yield batch
        finally:
            if prefetcher is not None:
                prefetcher.close()

    def start_at(self, samples: int) -> None:
        """The resumed run's slot (samples consumed so far); starts a pending new phase there."""
        if self._phase_start is None:
            self._phase_start = samples
            logger.info("%s: new phase from a single-dataset checkpoint, starting at sample %d", self.name, samples)

    def tokens_by_source(self) -> dict[str, int]:
        """Tokens (labels scored) each source gave over the run so far, earlier phases included."""
        return {s.name: before + taken * self.layout.seq_len
                for s, before, taken in zip(self.sources, self._tokens_before, self._taken)}

    # ---------------------------------------------------------- checkpoint

    def state_dict(self) -> dict[str, Any]:
        tokens = self.tokens_by_source()
        state: dict[str, Any] = {
            "mixture": {str(i): {"name": name, "weight": weight} for i, (name, weight) in enumerate(self.mixture)},
            "phase_start": self._phase_start if self._phase_start is not None else 0,
            # Plain ints (the counts may be NumPy's): a checkpoint's values are read without pickle.
            "taken": {str(i): int(t) for i, t in enumerate(self._taken)},
            "tokens": {str(i): int(tokens[s.name]) for i, s in enumerate(self.sources)},
            "seq_len": self.layout.seq_len,
            "local_batch_size": self.layout.local_batch_size,
            "shuffle": self.seed if self.shuffle else None,
        }
        if self.split is not None:
            state["split"] = self.split.to_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        check_position_maps(self.name, state_dict, self.layout.seq_len, self.split)
        if "mixture" not in state_dict:
            self._new_phase_from_single()
            return
        mine = self.seed if self.shuffle else None
        if state_dict.get("shuffle") != mine:
            raise ValueError(
                f"{self.name}: checkpoint was taken with shuffle seed {state_dict.get('shuffle')}, this run uses "
                f"{mine} (None: no shuffling); resume with the checkpoint's --training.shuffle and "
                "--training.shuffle_seed")
        saved = state_dict["mixture"]
        order = sorted(saved, key=int)
        theirs = [(str(saved[k]["name"]), float(saved[k]["weight"])) for k in order]
        taken = [int(state_dict["taken"][k]) for k in order]
        if Interleave([w for _, w in theirs]).counts_at(sum(taken)) != taken:
            raise ValueError(f"{self.name}: the checkpoint's counts per source {taken} are not the interleave's "
                             "after that many samples: the data position is damaged; load an earlier checkpoint")
        tokens = {name: int(state_dict["tokens"][k]) for (name, _), k in zip(theirs, order)}
        if theirs == self.mixture:
            self._phase_start, self._taken = int(state_dict["phase_start"]), taken
            self._tokens_before = [tokens[s.name] - t * self.layout.seq_len for s, t in zip(self.sources, taken)]
            return
        if not self.new_phase:  # a ConfigError: train.py prints it as one line on every rank
            raise ConfigError([
                f"dataset_mix: the checkpoint's mixture is {_describe(theirs)}, this run's is "
                f"{_describe(self.mixture)}; resume with the checkpoint's mixture, or pass {NEW_PHASE_OPTION} to "
                "start a new phase of this mixture at the resumed step"])
        self._phase_start = int(state_dict["phase_start"]) + sum(taken)
        self._taken = [0] * len(self.sources)
        self._tokens_before = [tokens.get(s.name, 0) for s in self.sources]
        logger.info("%s: new phase at sample %d (the checkpoint's mixture was %s)", self.name, self._phase_start,
                    _describe(theirs))

    def _new_phase_from_single(self) -> None:
        if not self.new_phase:
            raise ConfigError([
                f"dataset_mix: the checkpoint read a single dataset, this run reads the mixture "
                f"{_describe(self.mixture)}; resume with the checkpoint's --training.dataset/dataset_path, or pass "
                f"{NEW_PHASE_OPTION} to start the mixture as a new phase at the resumed step"])
        self._phase_start, self._taken = None, [0] * len(self.sources)
        self._tokens_before = [0] * len(self.sources)


def _dataset(loader: object) -> object:
    return getattr(loader, "dataset", loader)


def start_data_at(loader: object, samples: int) -> None:
    """Tell a mixture loader the resumed run's sample position (a no-op for other loaders)."""
    dataset = _dataset(loader)
    if isinstance(dataset, MixtureDataset):
        dataset.start_at(samples)


def mixture_metrics(loader: object) -> dict[str, float]:
    """``data/tokens/<source>``: the tokens each source of a mixture gave so far; empty for other loaders."""
    dataset = _dataset(loader)
    if not isinstance(dataset, MixtureDataset):
        return {}
    return {f"data/tokens/{name}": float(tokens) for name, tokens in dataset.tokens_by_source().items()}
