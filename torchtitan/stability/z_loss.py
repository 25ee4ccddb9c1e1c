"""z-loss (PaLM; OLMo): ``multiplier * logsumexp(logits)^2`` per scored token, which keeps the softmax's
normaliser near 1 so the output logits do not drift.

It is added to the loss that is back-propagated, and kept apart for logging: the logged ``loss`` stays the
cross-entropy (comparable with runs without it), and ``z_loss`` is logged beside it. Under loss parallel
the logits are sharded over the vocabulary; the log-sum-exp is then built from a max and a sum that
DTensor reduces over the tensor-parallel ranks, so no rank gathers the whole vocabulary.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate

from torchtitan.compat import in_pipeline_shape_inference
from torchtitan.distributed.collectives import local_value
from torchtitan.loss import IGNORE_INDEX
from torchtitan.train_step.objective import TermSources, TokenTerm


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


class ZLossTerm(TokenTerm):
    """z-loss as a term of the step's objective (``train_step/objective.py``): added after the cross-entropy to
    what is back-propagated, its sum kept apart and logged as ``z_loss`` (per token, over the data ranks).

    Through the pipeline it runs on the last stage only (inside the schedule), where the schedule's shape
    inference also calls it on stand-in tensors (not counted); the other stages' sums stay 0.
    """

    name = "z_loss"

    def __init__(self, multiplier: float):
        self.multiplier = multiplier
        self._sum: torch.Tensor | None = None  # float64: the sum since the last ``take_step_sum``

    @staticmethod
    def of(sources: TermSources) -> ZLossTerm | None:
        """The term of a job with ``--stability.z_loss_multiplier`` above 0, else None."""
        multiplier = sources.cfg.stability.z_loss_multiplier
        return ZLossTerm(multiplier) if multiplier > 0 else None

    def __call__(self, outputs: tuple[torch.Tensor, ...], labels: torch.Tensor) -> torch.Tensor:
        z = z_loss_sum(outputs[0], labels, self.multiplier)
        if not in_pipeline_shape_inference():  # a schedule's first step learns shapes on stand-in tensors
            kept = local_value(z).detach().double()
            self._sum = kept if self._sum is None else self._sum + kept
        return z

    def take_step_sum(self, device: torch.device) -> torch.Tensor:
        """The z-loss sum since the last call (zero on ``device`` when none), and start again."""
        kept, self._sum = self._sum, None
        return kept if kept is not None else torch.zeros((), dtype=torch.float64, device=device)
