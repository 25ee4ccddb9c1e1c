"""The running mean and standard deviation of the spike detector, kept on the device.

A ring buffer of the last ``window`` accepted values and a count of all accepted values, both
tensors: adding a value and reading the statistics are device ops, so a step that does not log
reads nothing on the host. A value is added only when its step was accepted (``accept``), so a
spike does not widen the band that the next values are judged by.
"""

from __future__ import annotations

import torch


class RunningStats:
    """Mean and sample standard deviation of the last ``window`` accepted values (float64, on ``device``)."""

    def __init__(self, window: int, device: torch.device):
        self.window = window
        self.values = torch.zeros(window, dtype=torch.float64, device=device)
        self.count = torch.zeros((), dtype=torch.int64, device=device)  # accepted values so far (not capped)

    def mean_std(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Over the ``min(count, window)`` values held; 0 and 0 before there are two (the sample std needs two)."""
        held = self.count.clamp(max=self.window)
        valid = torch.arange(self.window, device=self.values.device) < held
        n = held.clamp(min=1).double()
        mean = torch.where(valid, self.values, 0.0).sum() / n
        squares = torch.where(valid, (self.values - mean).square(), 0.0).sum()
        std = (squares / (held - 1).clamp(min=1).double()).sqrt()
        return mean, std

    def add(self, value: torch.Tensor, accept: torch.Tensor) -> None:
        """Add ``value`` in the oldest slot when ``accept`` (a 0-dim bool tensor) is true; else leave all as it is."""
        index = (self.count % self.window).reshape(1)
        old = self.values.index_select(0, index)
        self.values.index_copy_(0, index, torch.where(accept, value.double().reshape(1), old))
        self.count += accept.to(torch.int64)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"values": self.values, "count": self.count}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.values.copy_(state["values"])
        self.count.copy_(state["count"])
