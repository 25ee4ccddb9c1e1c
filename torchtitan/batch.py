"""A batch by name: what one (micro-)batch carries from the data loader through the step, the pipeline
and the planner.

The loaders yield ``(inputs, labels)`` or, under document masking, ``(inputs, labels, positions)``;
``Batch.of`` names those fields where a batch enters the model runner. A field added here
(an auxiliary target, expert loads) travels everywhere a batch goes without a caller counting
tuple positions: ``map`` applies a function to every tensor field, and ``model_kwargs`` hands the
model the fields its forward takes besides the tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Batch:
    """One local (micro-)batch: token ids ``[batch, seq]``, their labels, and optional fields."""

    inputs: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor | None = None  # each input's position within its document (block_causal)

    @classmethod
    def of(cls, item: Batch | Sequence[torch.Tensor]) -> Batch:
        """``item`` as a ``Batch``: a loader's ``(inputs, labels[, positions])`` tuple, or a batch already."""
        if isinstance(item, Batch):
            return item
        if not 2 <= len(item) <= 3:
            raise ValueError(f"a batch is (inputs, labels) or (inputs, labels, positions), got {len(item)} tensors")
        return cls(*item)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
        """This batch with ``fn`` applied to every tensor field (moving to a device, cutting to a CP share)."""
        changes = {f.name: fn(value) for f in dataclasses.fields(self)
                   if isinstance(value := getattr(self, f.name), torch.Tensor)}
        return dataclasses.replace(self, **changes)

    def model_kwargs(self) -> dict[str, Any]:
        """The keyword inputs of the model's forward besides the tokens (none when the fields are unset)."""
        return {} if self.positions is None else {"positions": self.positions}
