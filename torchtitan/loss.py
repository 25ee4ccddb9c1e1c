"""The loss and its one normalisation, shared by the training step (plain and pipelined) and evaluation.

A step's loss is the sum of its token cross-entropies over every rank and micro-batch,
divided by the step's global token count. Each rank back-propagates its own loss sum times
``LossScale``: ``dp_cp`` ranks over global tokens. FSDP/DDP average gradients over those
ranks, and the factor turns that average back into the sum, so the gradient is the same
whatever the data-parallel degree, the context-parallel degree and the accumulation.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.batch import Batch
from torchtitan.distributed.collectives import local_value, start_sum
from torchtitan.ops.cpu_kernels import cross_entropy_sum_sliced

IGNORE_INDEX = -100  # label of a position that is not scored


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor, cpu_slices: bool = True) -> torch.Tensor:
    """Sum (not mean) of the token cross-entropies of one micro-batch, in float32.

    Under loss parallel the logits are a DTensor sharded over the vocabulary and the result
    a replicated DTensor; the caller must be inside ``loss_parallel()``.

    On an eager CPU the logits are scored in row slices (ops/cpu_kernels.py): the same gradient
    bitwise, the value to rounding. ``cpu_slices=False`` makes the one call a GPU makes (the
    planner's dry run runs on CPU tensors what a GPU would).
    """
    logits, labels = logits.flatten(0, 1).float(), labels.flatten()
    sliced = cross_entropy_sum_sliced(logits, labels, IGNORE_INDEX) if cpu_slices else None
    if sliced is not None:
        return sliced
    return F.cross_entropy(logits, labels, reduction="sum", ignore_index=IGNORE_INDEX)


def cross_entropy_rows(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each row's sum of token cross-entropies, float64 ``[batch]``: a choice's negative log-likelihood
    (downstream evaluation scores one choice a row).

    Under loss parallel (inside ``loss_parallel()``) the per-token losses come back replicated over
    the vocabulary shards, so every TP rank holds every row's sum.
    """
    per_token = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none",
                                ignore_index=IGNORE_INDEX)
    return local_value(per_token).double().view(labels.shape).sum(dim=1)


def training_loss(device_type: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss a step on ``device_type`` computes: ``cross_entropy_sum`` as that device's kernels run it."""
    if device_type == "cpu":
        return cross_entropy_sum
    return functools.partial(cross_entropy_sum, cpu_slices=False)


def count_tokens(labels: torch.Tensor) -> torch.Tensor:
    """The positions of ``labels`` that are scored: an int64 count on their device (nothing read on the host)."""
    return (labels != IGNORE_INDEX).sum()


class LossScale:
    """The factor a step's loss sums are multiplied by before backward: ``mesh.size() / global tokens``.

    The global token count is summed in the background from construction on; calling the
    scale waits for it. The plain step calls it after the first forward, so no rank stops
    at a blocking collective for one number (benchmarks/overhead.py measures this). Counts
    and scale are float64 tensors on the labels' device: a step reads none of them on the host.
    """

    def __init__(self, batches: Sequence[Batch], mesh: DeviceMesh | None):
        local_tokens = torch.stack([count_tokens(batch.labels) for batch in batches]).sum()
        self._tokens_sum = start_sum(local_tokens.double(), mesh)
        self._ranks = 1 if mesh is None else mesh.size()
        self._global_tokens: torch.Tensor | None = None
        self._scale: torch.Tensor | None = None

    @property
    def ranks(self) -> int:
        """The ranks of the loss mesh, over which the gradients are averaged."""
        return self._ranks

    @property
    def global_tokens(self) -> torch.Tensor:
        if self._global_tokens is None:
            self._global_tokens = self._tokens_sum()
        return self._global_tokens

    def __call__(self) -> torch.Tensor:
        if self._scale is None:
            self._scale = scale_over(self._ranks, self.global_tokens)
        return self._scale


def scale_over(ranks: int, global_tokens: torch.Tensor) -> torch.Tensor:
    """``ranks / global_tokens`` in float64, rounded as the Python division of the two numbers.

    (``ranks / tensor`` would multiply by the reciprocal: another rounding, other gradients.)
    """
    return torch.full_like(global_tokens, ranks).div_(global_tokens)
