"""This DP rank's batches, read from a token store by window index, prepared one step ahead.

Global window ``i`` of an epoch is store window ``order(i)``: the identity
without shuffling, else a seeded permutation that depends on (store, seq_len,
seed, epoch) only (``window_order.WindowPermutation``).  Global batch ``s`` of a
pass is windows ``[s*B*D, (s+1)*B*D)`` and DP rank ``r`` gets ``[s*B*D + r*B, ...)``
(the dealing described in ``loaders.py``), so every layout and every
accumulation split sees the same global batches, and the saved position
(epoch, first window of the next global batch) resumes at any DP degree.
Finding a window is arithmetic, so a resume costs what a start costs, and a
rank reads only its own ``B`` windows per step.

A background thread reads the next batches while the training step runs
(``prefetch`` of them).  The position is advanced only when the consumer takes a
batch, so a checkpoint still records exactly what training consumed.  The thread is
stopped and joined when its iterator is closed or collected, and at the latest at the
interpreter's exit (``atexit``): a thread still inside a torch op while the interpreter
finalizes is killed as it retakes the GIL, and the unwinding through torch's C++ frames
aborts the process ("terminate called without an active exception", SIGABRT).
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import Stateful

from torchtitan.datasets.documents import document_positions
from torchtitan.datasets.layout import DataLayout
from torchtitan.datasets.split import SplitKey, describe
from torchtitan.datasets.token_store import TokenStore
from torchtitan.datasets.window_order import WindowPermutation

__all__ = ["TokenStoreDataset", "check_position_maps", "read_ahead"]

logger = logging.getLogger(__name__)

_END = object()


class _Prefetcher:
    """The reading thread of one iteration and its stop flag; ``close`` stops it and waits for it."""

    def __init__(self, work, stop: threading.Event, name: str):
        self.stop = stop
        self.thread = threading.Thread(target=work, name=f"prefetch:{name}", daemon=True)
        _LIVE.add(self)
        self.thread.start()

    def close(self, timeout: float = 10.0) -> None:
        self.stop.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            # The thread notices the flag within a put timeout (0.1 s) or after the batch it is reading.
            self.thread.join(timeout)


_LIVE: weakref.WeakSet[_Prefetcher] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """Before the interpreter finalizes: no reading thread may still run torch code then (module docstring)."""
    for prefetcher in list(_LIVE):
        prefetcher.close()


def check_position_maps(name: str, state_dict: dict[str, Any], seq_len: int, split: SplitKey | None) -> None:
    """A saved (epoch, window) position names the same windows only with the same seq_len and held-out split.

    Checkpoints taken before split keys existed saved the split in words; ``SplitKey.parse`` reads those too.
    """
    if state_dict["seq_len"] != seq_len:
        raise ValueError(
            f"{name}: checkpoint was taken with seq_len={state_dict['seq_len']}, "
            f"but this run uses seq_len={seq_len}; window positions cannot be mapped"
        )
    theirs = SplitKey.parse(state_dict.get("split"))
    if theirs != split:
        raise ValueError(
            f"{name}: checkpoint was taken with {describe(theirs)} but this run has "
            f"{describe(split)}; its data position does not map onto another split: resume "
            "with the checkpoint's --validation.held_out_fraction and --validation.split_seed"
        )


def read_ahead(produced: Iterator[tuple], depth: int, name: str) -> tuple[Iterator[tuple], _Prefetcher]:
    """``produced`` read ``depth`` items ahead on a thread; an item whose last element is None ends it.

    Errors of the thread are raised on the consumer's. Close the returned prefetcher when done.
    """
    buffer: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def work() -> None:
        try:
            for item in produced:
                while not stop.is_set():
                    try:
                        buffer.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set() or item[-1] is None:
                    return
        except BaseException as e:  # handed to the consumer, which raises it on the training thread
            buffer.put(e)
        buffer.put(_END)

    prefetcher = _Prefetcher(work, stop, name)

    def consume() -> Iterator:
        while True:
            item = buffer.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
            if item[-1] is None:
                return

    return consume(), prefetcher


class TokenStoreDataset(IterableDataset, Stateful):
    """Yields ``(inputs, labels)`` int64 batches of shape ``[layout.local_batch_size, layout.seq_len]``; with
    ``positions_bos``
    (the store's BOS id) ``(inputs, labels, positions)``, the inputs' positions within their documents
    (``documents.py``)."""

    def __init__(
        self,
        *,
        store: TokenStore,
        layout: DataLayout,
        infinite: bool = True,
        shuffle: bool = False,
        seed: int = 0,
        prefetch: int = 2,
        name: str = "dataset",
        positions_bos: int | None = None,
    ) -> None:
        self.store = store
        self.positions_bos = positions_bos
        self.layout = layout
        seq_len = layout.seq_len
        self.infinite = infinite
        self.shuffle = shuffle
        self.seed = seed
        self.prefetch = prefetch
        self.name = name
        self.split = store.split_key  # which documents the windows count in: part of the saved position
        self.n_windows = store.n_tokens // (seq_len + 1)
        try:
            store.check_fits(seq_len, layout.global_batch_size)
        except ValueError as e:
            raise type(e)(f"{name}: {e}") from None
        self._epoch = 0
        self._next_window = 0

    # ---------------------------------------------------------------- data

    def _order(self, epoch: int):
        if not self.shuffle:
            return lambda idx: idx
        return WindowPermutation(self.n_windows, self.seed, epoch)

    def _batch(self, windows: np.ndarray) -> tuple[torch.Tensor, ...]:
        width = self.layout.seq_len + 1
        rows = np.stack([self.store.read(int(w) * width, width) for w in windows])
        tokens = torch.from_numpy(rows)
        inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        if self.positions_bos is None:
            return inputs, labels
        return inputs, labels, document_positions(inputs, self.positions_bos)

    def _positions(self, epoch: int, base: int) -> Iterator[tuple[int, int, tuple[torch.Tensor, ...] | None]]:
        """(epoch, next_window after the batch, batch) from a position on; batch None ends a finite pass."""
        global_batch = self.layout.global_batch_size
        mine = np.arange(self.layout.local_batch_size, dtype=np.int64) + self.layout.first_row
        while True:
            order = self._order(epoch)
            # A pass counts its global batches from the position it starts at (see loaders.py).
            start = base
            while start + global_batch <= self.n_windows:
                yield epoch, start + global_batch, self._batch(order(start + mine))
                start += global_batch
            if not self.infinite:
                yield epoch, 0, None
                return
            epoch, base = epoch + 1, 0
            logger.info("%s: end of data, starting epoch %d", self.name, epoch)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        produced = self._positions(self._epoch, self._next_window)
        if self.prefetch <= 0:
            items, prefetcher = produced, None
        else:
            items, prefetcher = self._prefetched(produced)
        try:
            for epoch, next_window, batch in items:
                if batch is None:  # end of a finite pass
                    self._epoch, self._next_window = epoch + 1, 0
                    logger.info("%s: end of data after epoch %d", self.name, epoch)
                    return
                # Advance the position *before* yielding: the consumer may checkpoint while we are suspended.
                self._epoch, self._next_window = epoch, next_window
                yield batch
        finally:
            if prefetcher is not None:
                prefetcher.close()

    def _prefetched(self, produced: Iterator) -> tuple[Iterator, _Prefetcher]:
        return read_ahead(produced, self.prefetch, self.name)

    def rewind(self) -> None:
        self._epoch = self._next_window = 0

    # ---------------------------------------------------------- checkpoint

    def state_dict(self) -> dict[str, Any]:
        state = {
            "epoch": self._epoch,
            "next_window": self._next_window,
            "seq_len": self.layout.seq_len,
            "local_batch_size": self.layout.local_batch_size,
            "shuffle": self.seed if self.shuffle else None,
        }
        if self.split is not None:
            state["split"] = self.split.to_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "mixture" in state_dict:  # a position of datasets/mixture.py: it counts samples per source
            raise ValueError(
                f"{self.name}: the checkpoint read a mixture (--training.dataset_mix), this run one dataset; resume "
                "with the checkpoint's mixture, or give this dataset as a mixture of one source (weight 1) with "
                "--training.dataset_mix_new_phase to start it as a new phase")
        check_position_maps(self.name, state_dict, self.layout.seq_len, self.split)
        mine = self.seed if self.shuffle else None
        if "shuffle" in state_dict and state_dict["shuffle"] != mine:
            def say(s: Any) -> str:
                return "no shuffling" if s is None else f"shuffling with seed {s}"
            raise ValueError(
                f"{self.name}: checkpoint was taken with {say(state_dict['shuffle'])}, this run uses {say(mine)}; "
                "the window order would differ: resume with the checkpoint's --training.shuffle and "
                "--training.shuffle_seed"
            )
        self._epoch = int(state_dict["epoch"])
        self._next_window = int(state_dict["next_window"])
