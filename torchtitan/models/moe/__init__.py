"""Mixture-of-experts feed-forward, shared by the model families: routing, experts, dispatch, balancing.

- ``router``: ``TokenChoiceRouter`` (softmax/sigmoid, top-k, renormalise, scale, groups, bias);
- ``experts``: ``GroupedExperts`` (stacked SwiGLU experts, grouped GEMM or an exact loop);
- ``dispatch``: the deterministic sort/combine, ``LocalDispatcher`` and ``AllToAllDispatcher``;
- ``moe``: ``MoE`` and ``MoEArgs``, the feed-forward with its token counts;
- ``balance``: the auxiliary-loss-free bias update, auxiliary losses, imbalance;
- ``parallel``: ``apply_expert_parallel`` (experts sharded over an ``ep`` mesh).
"""

from torchtitan.models.moe.moe import MoE, MoEArgs

__all__ = ["MoE", "MoEArgs"]
