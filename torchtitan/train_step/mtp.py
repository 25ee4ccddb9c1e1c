"""Multi-token prediction in the training step: the extra loss of a model that predicts further ahead
(DeepSeek-V3's MTP modules, models/deepseek_v3/mtp.py), and its own log line entry.

A model takes part when it has ``pop_mtp_outputs`` and its args a positive ``num_mtp_layers``: the step
then passes it the labels, scores each depth's logits with the step's own loss function (sums of token
cross-entropies) and back-propagates ``main + mtp_loss_weight / D * sum_k depth_k`` through the same
loss scale, i.e. over the main loss's token count (the report's 1/T). The logged loss stays the main
one; ``mtp/loss`` is the mean over the depths of ``depth_k / T``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, cast

import torch
import torch.distributed as dist
from torch import nn

from torchtitan.distributed.collectives import local_value
from torchtitan.loss import count_tokens


class MultiTokenModel(Protocol):
    """What the step asks of a model with multi-token prediction (models/deepseek_v3/model.py)."""

    def pop_mtp_outputs(self) -> list[tuple[torch.Tensor, torch.Tensor]]: ...


def mtp_settings(model: nn.Module) -> tuple[int, float]:
    """(depths, loss weight) of the model's multi-token prediction; depths 0: none."""
    args = getattr(model, "args", None)
    depths = getattr(args, "num_mtp_layers", 0)
    if not hasattr(model, "pop_mtp_outputs") or not isinstance(depths, int) or depths < 1:
        return 0, 0.0
    return depths, float(getattr(args, "mtp_loss_weight"))  # noqa: B009 - args is untyped here


class MTPLoss:
    """The weighted MTP loss sum of each micro-batch, and the window's logged value (see the module docstring)."""

    def __init__(self, depths: int, weight: float):
        self.depths, self.weight = depths, weight
        self._sum = torch.zeros((), dtype=torch.float64)
        self._tokens = torch.zeros((), dtype=torch.float64)

    def objective(self, model: nn.Module, labels: torch.Tensor,
                  loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``weight / D * sum_k`` of the depths' loss sums of the model's last forward (kept for the log)."""
        outputs = cast(MultiTokenModel, model).pop_mtp_outputs()
        total = torch.stack([loss_fn(logits, targets) for logits, targets in outputs]).sum()
        self._sum = self._sum.to(total.device) + local_value(total).detach().double()
        self._tokens = self._tokens.to(labels.device) + count_tokens(labels).double()
        return total * (self.weight / self.depths)

    def metrics(self, group: dist.ProcessGroup | None) -> dict[str, float]:
        """``mtp/loss`` over the data ranks (``group``) since the last call; a collective on logging steps."""
        sums = torch.stack([self._sum, self._tokens.to(self._sum.device)])
        if dist.is_initialized() and group is not None:
            dist.all_reduce(sums, group=group)
        self._sum, self._tokens = torch.zeros_like(self._sum), torch.zeros_like(self._tokens)
        return {"mtp/loss": float(sums[0] / (self.depths * sums[1]))} if sums[1] > 0 else {}
