"""The training batches of a fault-tolerant group, which a heal can move to a peer's position."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torchdata.stateful_dataloader import StatefulDataLoader


class RepositionableBatches(Iterator[tuple[torch.Tensor, torch.Tensor]]):
    """``iter(dataloader)`` that can be restarted at another position (a healed group takes its peer's)."""

    def __init__(self, dataloader: StatefulDataLoader):
        self.dataloader = dataloader
        self._it = iter(dataloader)

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return next(self._it)

    def position(self) -> dict[str, Any]:
        return self.dataloader.state_dict()

    def move_to(self, position: dict[str, Any]) -> None:
        self.dataloader.load_state_dict(position)
        self._it = iter(self.dataloader)
