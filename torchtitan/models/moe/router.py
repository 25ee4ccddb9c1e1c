"""Token-choice top-k routing: which experts each token goes to, and with what weight.

The gate runs in float32 whatever the parameter dtype (small logit differences decide the
choice). Scores are a softmax or a sigmoid over the experts. An optional per-expert bias
(auxiliary-loss-free balancing, DeepSeek-V3) and group-limited routing change which experts
are chosen; the weights always come from the unbiased scores.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from torchtitan.distributed.collectives import sum_grad_over

ScoreFunc = Literal["softmax", "sigmoid"]


def check_routing(num_experts: int, top_k: int, score_func: str, num_groups: int, topk_groups: int) -> None:
    """ValueError, one line naming the option, for routing options that cannot work together."""
    if num_experts < 1 or not 1 <= top_k <= num_experts:
        raise ValueError(f"moe top_k={top_k} must be between 1 and num_experts={num_experts}")
    if score_func not in ("softmax", "sigmoid"):
        raise ValueError(f"moe score_func={score_func!r} is unknown; choose softmax or sigmoid")
    if num_groups < 1 or num_experts % num_groups:
        raise ValueError(f"moe num_groups={num_groups} must divide num_experts={num_experts}")
    if not 1 <= topk_groups <= num_groups:
        raise ValueError(f"moe topk_groups={topk_groups} must be between 1 and num_groups={num_groups}")
    if top_k > topk_groups * (num_experts // num_groups):
        raise ValueError(f"moe top_k={top_k} exceeds the {topk_groups * (num_experts // num_groups)} experts "
                         f"of the topk_groups={topk_groups} groups kept; raise topk_groups")


class TokenChoiceRouter(nn.Module):
    """``forward(x [T, D]) -> (weights [T, k] float32, experts [T, k] int64, scores [T, E] float32)``.

    ``scores`` are the unbiased softmax/sigmoid scores of every expert (what auxiliary
    losses use); ``weights`` are the chosen experts' scores, renormalised to sum to one when
    ``norm_topk_prob`` and multiplied by ``route_scale``. ``gate_bias``: the gate's logits have a
    learned bias (GPT-OSS); a softmax renormalised over the top k equals GPT-OSS's softmax over the
    top k logits. With ``load_balance_bias`` the
    persistent buffer ``expert_bias [E]`` (checkpointed, zero at first) is added to the scores
    for the choice only; ``models/expert_balance.update_expert_bias`` moves it.
    """

    def __init__(self, dim: int, num_experts: int, top_k: int, score_func: ScoreFunc = "softmax",
                 norm_topk_prob: bool = False, route_scale: float = 1.0, num_groups: int = 1, topk_groups: int = 1,
                 load_balance_bias: bool = False, gate_bias: bool = False):
        super().__init__()
        check_routing(num_experts, top_k, score_func, num_groups, topk_groups)
        self.num_experts, self.top_k, self.score_func = num_experts, top_k, score_func
        self.norm_topk_prob, self.route_scale = norm_topk_prob, route_scale
        self.num_groups, self.topk_groups = num_groups, topk_groups
        self.gate = nn.Linear(dim, num_experts, bias=gate_bias)  # GPT-OSS's router has a learned bias
        # The TP ranks that route different tokens with this router (moe/parallel.split_over_tp): the gate's
        # gradient is summed over them (None: they route the same tokens, or there is no TP).
        self.grad_group: dist.ProcessGroup | None = None
        self.expert_bias: torch.Tensor | None
        if load_balance_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32), persistent=True)
        else:
            self.expert_bias = None

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """Every expert's score in float32, autocast off so the logits stay float32 on any device."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            weight = sum_grad_over(self.gate.weight, self.grad_group)
            bias = None if self.gate.bias is None else sum_grad_over(self.gate.bias, self.grad_group).float()
            logits = F.linear(x.float(), weight.float(), bias)
        return logits.softmax(dim=-1) if self.score_func == "softmax" else logits.sigmoid()

    def _limit_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """Mask (to -inf) every expert outside the ``topk_groups`` best groups of each token.

        A group's score is the sum of its two best experts' scores (one when a group has one expert).
        """
        tokens = choice.shape[0]
        grouped = choice.view(tokens, self.num_groups, -1)
        best = min(2, grouped.shape[-1])
        group_scores = grouped.topk(best, dim=-1).values.sum(dim=-1)
        keep = group_scores.topk(self.topk_groups, dim=-1).indices
        mask = torch.zeros(tokens, self.num_groups, dtype=torch.bool, device=choice.device)
        mask.scatter_(1, keep, True)
        return grouped.masked_fill(~mask.unsqueeze(-1), float("-inf")).view(tokens, -1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scores = self.scores(x)
        choice = scores.detach() if self.expert_bias is None else scores.detach() + self.expert_bias
        if self.num_groups > 1 and self.topk_groups < self.num_groups:
            choice = self._limit_groups(choice)
        # sorted=True: a fixed slot order per token, so the combine sums the k outputs in one order.
        experts = choice.topk(self.top_k, dim=-1, sorted=True).indices
        weights = scores.gather(-1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if self.route_scale != 1.0:
            weights = weights * self.route_scale
        return weights, experts, scores
