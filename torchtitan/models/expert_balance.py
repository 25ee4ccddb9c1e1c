"""What the trainer asks of a mixture-of-experts layer, and the balancing it runs over such layers.

The trainer never imports the MoE component (``models/moe``): it gets a model part's MoE layers from
the family's ``ModelSpec.expert_layers`` as ``ExpertLayer``s and balances them with the functions here,
which read and write nothing else of a layer.

- ``update_expert_bias``: DeepSeek-V3's auxiliary-loss-free balancing. Before each optimizer
  step the token counts of every MoE layer are summed over the data ranks; each expert's
  bias moves by ``coeff * sign(mean - count)`` (up when it got fewer tokens than the mean),
  recentred so the biases keep a zero mean; then the counts are zeroed. Being called once
  per optimizer step, it sees the counts of every micro-batch of that step.
- ``reduce_counts``: the layers' counts summed over a process group.
- ``imbalance``: max over mean tokens per expert, per layer (what the trainer logs, and what the
  planner's ``--moe_imbalance`` means).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist


class ExpertLayer(Protocol):
    """One MoE layer as the trainer balances and logs it (``models/moe``'s ``MoE`` is one)."""

    # [E] int64: the (token, slot) pairs this rank routed to each expert since they were last zeroed
    # (training forwards only, never an activation-checkpoint recompute)
    tokens_per_expert: torch.Tensor

    @property
    def expert_bias(self) -> torch.Tensor | None:
        """The routing bias [E] that ``update_expert_bias`` moves (None: the layer has none)."""
        ...

    @property
    def aux_loss_coeff(self) -> float:
        """The weight of the layer's auxiliary balance loss (0: none). The loss itself travels with the model's
        output (``models/aux_loss.py``), and the step's loss weighs it (``train_step/aux_loss.py``)."""
        ...


def reduce_counts(counts: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The layers' token counts ``[L, E]`` summed over ``group`` (one all-reduce; None: this rank's)."""
    stacked = torch.stack([c.detach() for c in counts])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(stacked, group=group)
    return stacked


@torch.no_grad()
def update_expert_bias(layers: Sequence[ExpertLayer], coeff: float,
                       group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Move each layer's ``expert_bias`` from its step's counts; zero the counts. Returns them ``[L, E]``.

    A collective over ``group``: every rank of it calls this with the same number of layers.
    Layers without a bias only have their counts zeroed; the returned counts serve logging.
    """
    if not layers:
        return torch.zeros(0, 0)
    totals = reduce_counts([layer.tokens_per_expert for layer in layers], group)
    for layer, count in zip(layers, totals, strict=True):
        bias = layer.expert_bias
        if bias is not None:
            count = count.to(bias.dtype)
            delta = coeff * torch.sign(count.mean() - count)
            bias.add_(delta - delta.mean())
        layer.tokens_per_expert.zero_()
    return totals


def imbalance(counts: torch.Tensor) -> torch.Tensor:
    """Max over mean tokens per expert of each layer of ``counts [L, E]`` (1 is perfect balance; 0 without tokens)."""
    counts = counts.double()
    mean = counts.mean(dim=-1)
    return torch.where(mean > 0, counts.amax(dim=-1) / mean.clamp_min(1e-30), torch.zeros_like(mean))
