"""Multi-token prediction in the training step: the loss of a model that also predicts further ahead
(DeepSeek-V3's MTP modules, models/deepseek_v3/mtp.py), and its own log line entry.

A model takes part when its args have a positive ``num_mtp_layers``: the step then passes it the batch's
input ids as ``mtp_tokens`` and gets back ``(logits, depth 1's logits, ..., depth D's)`` from the model, or
from the pipeline's last stage, which holds the MTP modules. ``MTPTerm`` is its term of the step's objective
(``train_step/objective.py``), the same in one process and on the last stage (inside the pipeline schedule):
the step back-propagates ``main + mtp_loss_weight / D * sum_k depth_k``, ``main`` the terms before it
(the cross-entropy of the logits, plus z-loss when that is on) and each
``depth_k`` the sum of token cross-entropies against the labels ``k`` places further on, all through the
same loss scale, i.e. over the main loss's token count (the report's 1/T). The logged loss stays the main
one; ``mtp/loss`` is the mean over the depths of ``depth_k / T``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from torchtitan.compat import in_pipeline_shape_inference
from torchtitan.distributed.collectives import local_value
from torchtitan.loss import IGNORE_INDEX, count_tokens
from torchtitan.models.spec import family_model
from torchtitan.train_step.objective import Groups, LossFn, TermSources, TokenTerm


def mtp_settings(model: nn.Module) -> tuple[int, float]:
    """(depths, loss weight) of the model's multi-token prediction; depths 0: none."""
    return family_model(model, "mtp_settings").mtp_objective()


def depth_targets(labels: torch.Tensor, k: int) -> torch.Tensor:
    """Depth ``k``'s labels [B, L]: the main loss's (labels[i] = t_{i+1}) rolled ``k`` left, the last ``k``
    not scored (their token lies beyond the sequence)."""
    targets = torch.roll(labels, -k, dims=1).clone()
    targets[:, -k:] = IGNORE_INDEX
    return targets


class MTPTerm(TokenTerm):
    """The depths' term of the step's objective, and the sums it logs (see the module docstring).

    ``depth_loss`` scores each depth's logits (the plain cross-entropy). The schedule's shape inference
    calls it on stand-in tensors: not counted.
    """

    name = "mtp/loss"

    def __init__(self, depths: int, weight: float, depth_loss: LossFn):
        self.depths, self.weight, self.depth_loss = depths, weight, depth_loss
        self._sum = torch.zeros((), dtype=torch.float64)  # the depths' loss sum since the last metrics
        self._tokens = torch.zeros((), dtype=torch.float64)

    @staticmethod
    def of(sources: TermSources) -> MTPTerm | None:
        """The term of a model with multi-token prediction depths, else None."""
        depths, weight = mtp_settings(sources.model)
        return MTPTerm(depths, weight, sources.loss_fn) if depths else None

    def model_kwargs(self, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """What the model's forward takes besides the batch's own fields: the input ids its depths embed."""
        return {"mtp_tokens": inputs}

    def __call__(self, outputs: tuple[torch.Tensor, ...], labels: torch.Tensor) -> torch.Tensor:
        if len(outputs) != 1 + self.depths:
            raise ValueError(f"multi-token prediction with {self.depths} depths expects the main logits and one per "
                             f"depth from the model, got {len(outputs)} outputs")
        depths = outputs[1:]
        total = self.depth_loss(depths[0], depth_targets(labels, 1))
        for k, out in enumerate(depths[1:], start=2):  # added one by one: a DTensor under loss parallel
            total = total + self.depth_loss(out, depth_targets(labels, k))
        if not in_pipeline_shape_inference():
            kept = local_value(total).detach().double()
            self._sum = self._sum.to(kept.device) + kept
            self._tokens = self._tokens.to(labels.device) + count_tokens(labels).double()
        return total * (self.weight / self.depths)

    def metrics(self, groups: Groups) -> dict[str, float]:
        """``mtp/loss`` since the last call, summed over ``groups`` (the data ranks; the pipeline's, whose last
        stage alone holds the sums); a collective on logging steps."""
        sums = torch.stack([self._sum, self._tokens.to(self._sum.device)])
        for group in groups:
            if dist.is_initialized() and group is not None:
                dist.all_reduce(sums, group=group)
        self._sum, self._tokens = torch.zeros_like(self._sum), torch.zeros_like(self._tokens)
        return {self.name: float(sums[0] / (self.depths * sums[1]))} if sums[1] > 0 else {}
