"""Load balancing of the experts: the auxiliary-loss-free bias update, auxiliary losses, imbalance.

- ``update_expert_bias``: DeepSeek-V3's auxiliary-loss-free balancing. Before each optimizer
  step the token counts of every MoE layer are summed over the data ranks; each expert's
  bias moves by ``coeff * sign(mean - count)`` (up when it got fewer tokens than the mean),
  recentred so the biases keep a zero mean; then the counts are zeroed. Being called once
  per optimizer step, it sees the counts of every micro-batch of that step.
- ``switch_aux_loss``: Switch-Transformer style, as Hugging Face's Qwen3-MoE computes it
  (``load_balancing_loss_func``): ``E * sum_e f_e * P_e`` with ``f_e`` the (token, slot)
  pairs routed to ``e`` per token and ``P_e`` the mean score of ``e``.
- ``sequence_aux_loss``: DeepSeek-V3's sequence-wise loss (eqs. 17-20): per sequence
  ``sum_e f_e * P_e`` with ``f_e = E / (k S) * pairs_e`` and ``P_e`` the mean of the scores
  normalised to sum to one per token, averaged over the sequences.
- ``imbalance``: max over mean tokens per expert, per layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
import torch.distributed as dist


def reduce_counts(counts: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The layers' token counts ``[L, E]`` summed over ``group`` (one all-reduce; None: this rank's)."""
    stacked = torch.stack([c.detach() for c in counts])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(stacked, group=group)
    return stacked


@torch.no_grad()
def update_expert_bias(moes: Sequence[torch.nn.Module], coeff: float,
                       group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Move each layer's ``router.expert_bias`` from its step's counts; zero the counts. Returns them ``[L, E]``.

    ``moes`` are ``MoE`` modules (``tokens_per_expert`` buffer, ``router.expert_bias`` or None).
    A collective over ``group``: every rank of it calls this with the same number of layers.
    Layers without a bias only have their counts zeroed; the returned counts serve logging.
    """
    if not moes:
        return torch.zeros(0, 0)
    # nn.Module types a buffer or submodule as Tensor | Module; these are MoE modules (see above).
    totals = reduce_counts([cast(torch.Tensor, m.tokens_per_expert) for m in moes], group)
    for moe, count in zip(moes, totals, strict=True):
        bias = cast("torch.Tensor | None", cast(torch.nn.Module, moe.router).expert_bias)
        if bias is not None:
            count = count.to(bias.dtype)
            delta = coeff * torch.sign(count.mean() - count)
            bias.add_(delta - delta.mean())
        cast(torch.Tensor, moe.tokens_per_expert).zero_()
    return totals


def imbalance(counts: torch.Tensor) -> torch.Tensor:
    """Max over mean tokens per expert of each layer of ``counts [L, E]`` (1 is perfect balance; 0 without tokens)."""
    counts = counts.double()
    mean = counts.mean(dim=-1)
    return torch.where(mean > 0, counts.amax(dim=-1) / mean.clamp_min(1e-30), torch.zeros_like(mean))


def _pairs_per_expert(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(token, slot) pairs per expert along the last dim, float32: ``experts [..., T, k] -> [..., E]``."""
    one_hot = torch.nn.functional.one_hot(experts, num_experts).to(torch.float32)
    return one_hot.sum(dim=(-3, -2))


def switch_aux_loss(scores: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """``E * sum_e (pairs_e / T) * mean_t scores[t, e]`` for ``scores [T, E]``, ``experts [T, k]``."""
    num_tokens, num_experts = scores.shape
    fraction = _pairs_per_expert(experts, num_experts) / num_tokens
    return num_experts * (fraction * scores.float().mean(dim=0)).sum()


def sequence_aux_loss(scores: torch.Tensor, experts: torch.Tensor, num_sequences: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss (without its coefficient), for tokens in sequence order."""
    num_tokens, num_experts = scores.shape
    top_k = experts.shape[-1]
    seq_len = num_tokens // num_sequences
    scores = scores.float().view(num_sequences, seq_len, num_experts)
    normalised = scores / scores.sum(dim=-1, keepdim=True).clamp_min(1e-20)
    pairs = _pairs_per_expert(experts.view(num_sequences, seq_len, top_k), num_experts)
    fraction = pairs * (num_experts / (top_k * seq_len))
    return (fraction * normalised.mean(dim=1)).sum(dim=-1).mean()


def aux_loss(kind: str, scores: torch.Tensor, experts: torch.Tensor, num_sequences: int) -> torch.Tensor:
    """The auxiliary loss named ``kind`` ("switch" or "sequence")."""
    if kind == "switch":
        return switch_aux_loss(scores, experts)
    if kind == "sequence":
        return sequence_aux_loss(scores, experts, num_sequences)
    raise ValueError(f"moe aux_loss={kind!r} is unknown; choose switch or sequence (or none)")


def register_bias_update_hook(optimizer: torch.optim.Optimizer, moes: Sequence[torch.nn.Module], coeff: float,
                              group: dist.ProcessGroup | None = None) -> torch.utils.hooks.RemovableHandle:
    """Run ``update_expert_bias`` before every ``optimizer.step()`` (after all micro-batches of the step)."""

    def hook(*_: object) -> None:  # a pre-hook's non-None return would replace step()'s arguments
        update_expert_bias(moes, coeff, group)

    return optimizer.register_step_pre_hook(hook)
