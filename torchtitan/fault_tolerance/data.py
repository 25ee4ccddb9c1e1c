"""The training position of a fault-tolerant group (step and batches), which a heal can move to a peer's."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

logger = logging.getLogger(__name__)


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


class GroupPosition:
    """The step being taken and the batches after it: what a healing group receives from a live peer.

    ``HealState`` hands ``state`` to a healing peer and calls ``load`` on this group when it
    heals; the step strategy sets ``step`` before each step and returns it after (a heal moves it).
    """

    def __init__(self, dataloader: StatefulDataLoader):
        self.dataloader = dataloader
        self.step = 0
        self.batches: RepositionableBatches | None = None  # made by start(), after a checkpoint is loaded
        self.heals = 0  # times this group took a peer's state

    def start(self) -> RepositionableBatches:
        self.batches = RepositionableBatches(self.dataloader)
        return self.batches

    def state(self) -> dict[str, Any]:
        assert self.batches is not None, "start() runs before any heal"
        return {"step": self.step, "data": self.batches.position()}

    def load(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        assert self.batches is not None, "start() runs before any heal"
        self.batches.move_to(state["data"])
        self.heals += 1
        logger.info("Fault tolerance: healed from a live peer at step %d", self.step)
