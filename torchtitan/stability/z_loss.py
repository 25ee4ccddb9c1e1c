"""z-loss (PaLM; OLMo): ``multiplier * logsumexp(logits)^2`` per scored token, which keeps the softmax's
normaliser near 1 so the output logits do not drift.

It is added to the loss that is back-propagated, and kept apart for logging: the logged ``loss`` stays the
cross-entropy (comparable with runs without it), and ``z_loss`` is logged beside it. Under loss parallel
the logits are sharded over the vocabulary; the log-sum-exp is then built from a max and a sum that
DTensor reduces over the tensor-parallel ranks, so no rank gathers the whole vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor, Replicate

from torchtitan.compat import in_pipeline_shape_inference
from torchtitan.distributed.collectives import local_value
from torchtitan.loss import IGNORE_INDEX

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """``logsumexp`` over the last dim, written with ops DTensor shards (a plain tensor takes the same path)."""
    shift = logits.detach().amax(dim=-1, keepdim=True)  # no gradient through the max: it cancels out
    if isinstance(logits, DTensor) and isinstance(shift, DTensor):
        # The max over every vocabulary shard, the same on every rank.
        shift = shift.redistribute(logits.device_mesh, [Replicate()] * logits.device_mesh.ndim)
    summed = (logits - shift).exp().sum(dim=-1)
    return summed.log() + shift.squeeze(-1)


def z_loss_sum(logits: torch.Tensor, labels: torch.Tensor, multiplier: float) -> torch.Tensor:
    """``multiplier`` times the sum, over the positions ``labels`` scores, of ``logsumexp(logits)^2`` (float32).

    A replicated DTensor under loss parallel (like the cross-entropy's sum), else a plain 0-dim tensor.
    """
    lse = _logsumexp(logits.flatten(0, 1).float())
    scored = labels.flatten() != IGNORE_INDEX
    if isinstance(lse, DTensor):
        scored = DTensor.from_local(scored, lse.device_mesh, lse.placements, run_check=False)
    return (lse.square() * scored).sum() * multiplier


class WithZLoss:
    """A training loss plus z-loss; keeps the detached sums of both parts since the last ``pop``.

    The step back-propagates ``loss_fn + z_loss`` and logs the two sums apart. Through the pipeline it runs
    on the last stage only (inside the schedule), where the schedule's shape inference also calls it on
    stand-in tensors (not counted); the other stages' sums stay 0.
    """

    def __init__(self, loss_fn: LossFn, multiplier: float):
        self.loss_fn, self.multiplier = loss_fn, multiplier
        self._sums: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = self.loss_fn(logits, labels)
        z = z_loss_sum(logits, labels, self.multiplier)
        if in_pipeline_shape_inference():  # a schedule's first step learns shapes on stand-in tensors: not counted
            return loss + z
        parts = (local_value(loss).detach().double(), local_value(z).detach().double())
        self._sums = parts if self._sums is None else (self._sums[0] + parts[0], self._sums[1] + parts[1])
        return loss + z

    def pop(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The (loss, z-loss) sums since the last pop (zeros on ``device`` when none), and start again."""
        sums = self._sums
        self._sums = None
        if sums is None:
            zero = torch.zeros((), dtype=torch.float64, device=device)
            return zero, zero.clone()
        return sums
