"""The auxiliary balance losses of a MoE layer's forward (the step's bias update, which the trainer runs
over every layer, is ``models/expert_balance.py``).

- ``switch_aux_loss``: Switch-Transformer style, as Hugging Face's Qwen3-MoE computes it
  (``load_balancing_loss_func``): ``E * sum_e f_e * P_e`` with ``f_e`` the (token, slot)
  pairs routed to ``e`` per token and ``P_e`` the mean score of ``e``.
- ``sequence_aux_loss``: DeepSeek-V3's sequence-wise loss (eqs. 17-20): per sequence
  ``sum_e f_e * P_e`` with ``f_e = E / (k S) * pairs_e`` and ``P_e`` the mean of the scores
  normalised to sum to one per token, averaged over the sequences.
"""

from __future__ import annotations

import torch


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

