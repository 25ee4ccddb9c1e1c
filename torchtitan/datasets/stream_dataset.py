"""Hub streaming mode: each DP rank reads, tokenizes and packs only its own documents.

For hub datasets (``c4``) preparing a token store up front is often not wanted.
Then each DP rank streams its own subset of the documents
(``datasets.distributed.split_dataset_by_node``: whole files when the number of
files divides evenly, else every D-th record), packs them into ``seq_len + 1``
windows and yields local batches.  Per-rank cost stays flat as DP grows.

What this mode gives up, plainly: **the sample order depends on the DP degree**.
Another DP degree reads other documents on each rank, so layouts with different
DP degrees train on different batches, and a checkpoint resumes only at the DP
degree it was taken with (the loader refuses any other).  Ranks may also run out
of data at different steps on a finite pass.  Use a token store when this matters.

The checkpoint holds, per DP rank, the streaming dataset's own position
(``datasets.IterableDataset.state_dict``) and the tokens left over from the last
document, so a resume continues exactly.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import Stateful

from torchtitan.datasets.documents import document_positions
from torchtitan.datasets.layout import DataLayout
from torchtitan.datasets.split import HeldOutSplit
from torchtitan.datasets.tokenizer import Tokenizer

__all__ = ["ShardedStreamDataset"]

logger = logging.getLogger(__name__)


class ShardedStreamDataset(IterableDataset, Stateful):
    """Yields ``(inputs, labels)`` batches ``[layout.local_batch_size, layout.seq_len]`` from this DP rank's
    documents; with ``positions`` also the inputs' positions within their documents (``documents.py``)."""

    def __init__(self, *, source, text_field: str, tokenizer: Tokenizer, layout: DataLayout, infinite: bool = True,
                 name: str = "dataset", split: HeldOutSplit | None = None, held_out: bool = False,
                 positions: bool = False) -> None:
        """``split``: keep only the documents it does not hold out (``held_out=False``) or only those it does."""
        from datasets.distributed import split_dataset_by_node

        self.source = split_dataset_by_node(source, rank=layout.dp_rank, world_size=layout.dp_degree)
        self.text_field = text_field
        self.tokenizer = tokenizer
        self.layout = layout
        self.infinite = infinite
        self.name = name
        self.split = split
        self.held_out = held_out
        self.positions = positions
        self._epoch = 0
        self._buffer: list[int] = []

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        width, rows_per_batch = self.layout.seq_len + 1, self.layout.local_batch_size
        need = width * rows_per_batch
        while True:
            self.source.set_epoch(self._epoch)
            for record in self.source:
                text = record.get(self.text_field)
                if not text or (self.split is not None and self.split.held_out(text) != self.held_out):
                    continue
                self._buffer.extend(self.tokenizer.encode(text, bos=True, eos=True))
                while len(self._buffer) >= need:
                    rows = torch.tensor(self._buffer[:need], dtype=torch.long).view(rows_per_batch, width)
                    # Cut before yielding: a checkpoint taken while suspended holds the rest only.
                    del self._buffer[:need]
                    inputs, labels = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
                    if self.positions:
                        yield inputs, labels, document_positions(inputs, self.tokenizer.bos_id)
                    else:
                        yield inputs, labels
            self._epoch += 1
            self._buffer.clear()
            if not self.infinite:
                return
            logger.info("%s: DP rank %d: end of its documents, epoch %d", self.name, self.layout.dp_rank, self._epoch)

    def rewind(self) -> None:
        """Back to the first document of this rank (a validation pass starts here every time)."""
        self._epoch = 0
        self._buffer.clear()

    def state_dict(self) -> dict[str, Any]:
        mine = {"epoch": self._epoch, "buffer": self._buffer, "source": self.source.state_dict()}
        layout = self.layout
        return {
            "mode": "sharded_stream", "dp_degree": layout.dp_degree, "seq_len": layout.seq_len,
            "local_batch_size": layout.local_batch_size,
            # One entry per DP rank (ranks hold different positions); JSON text, so DCP keeps it as one value
            # and a checkpoint from elsewhere is never unpickled.
            "ranks": {f"dp_rank{layout.dp_rank}": json.dumps(mine, sort_keys=True)},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        layout = self.layout
        if state_dict.get("mode") != "sharded_stream" or state_dict["dp_degree"] != layout.dp_degree:
            raise ValueError(
                f"{self.name}: streamed per DP rank, the data order depends on the DP degree; this checkpoint was "
                f"taken with {state_dict.get('dp_degree', 'a global stream')!r}, this run has DP degree "
                f"{layout.dp_degree}: resume with the checkpoint's DP degree, or train from a token store "
                "(scripts/prepare_data.py), which resumes at any DP degree"
            )
        if (state_dict["seq_len"], state_dict["local_batch_size"]) != (layout.seq_len, layout.local_batch_size):
            raise ValueError(f"{self.name}: streamed per DP rank, a checkpoint resumes only with its seq_len "
                             f"({state_dict['seq_len']}) and local batch size ({state_dict['local_batch_size']})")
        mine = state_dict["ranks"][f"dp_rank{layout.dp_rank}"]
        if not isinstance(mine, str):
            raise ValueError(f"{self.name}: the checkpoint's stream position was written by an older version as a "
                             "pickle, which is not loaded (a crafted checkpoint would run code); resume with "
                             "--checkpoint.exclude_from_loading dataloader, or start a new run")
        mine = json.loads(mine)
        self._epoch, self._buffer = mine["epoch"], list(mine["buffer"])
        self.source.load_state_dict(mine["source"])
