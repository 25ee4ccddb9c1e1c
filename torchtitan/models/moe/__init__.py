"""Mixture-of-experts feed-forward, shared by the model families: routing, experts, dispatch, balancing.

- ``router``: ``TokenChoiceRouter`` (softmax/sigmoid, top-k, renormalise, scale, groups, bias);
- ``experts``: ``GroupedExperts`` (stacked SwiGLU experts, grouped GEMM or an exact loop);
- ``dispatch``: the deterministic sort/combine, ``LocalDispatcher`` and ``AllToAllDispatcher``;
- ``moe``: ``MoE`` and ``MoEArgs``, the feed-forward with its token counts; ``moe_layers`` of a model;
- ``balance``: the auxiliary losses (the step's bias update over the layers: ``models/expert_balance.py``);
- ``assumed``: dispatchers on assumed counts, for the planner's dry run (``ModelSpec.assume_routing``);
- ``parallel``: ``apply_expert_parallel`` (experts sharded over an ``ep`` mesh).
"""

from torchtitan.models.moe.moe import MoE, MoEArgs, moe_layers

__all__ = ["MoE", "MoEArgs", "moe_layers"]
