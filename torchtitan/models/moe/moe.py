"""The mixture-of-experts feed-forward: router -> routed experts (through a dispatcher) -> + shared experts.

``MoE(MoEArgs)`` replaces a dense feed-forward: ``forward(x [..., D]) -> [..., D]``. It keeps,
for balancing and logging, the (token, slot) pairs each expert received since they were last
consumed, in the non-persistent buffer ``tokens_per_expert [E]`` (int64, this rank's tokens):
counted in training mode only, once per forward (never again in an activation-checkpoint
recompute, nor in a pipeline stage's shape inference), summed over micro-batches until
``models/expert_balance.update_expert_bias`` zeroes them. ``MoE`` is the ``ExpertLayer`` that the
trainer balances (``models/expert_balance.py``); ``moe_layers`` finds them in a model.

With an auxiliary balance loss (``aux_loss`` and a positive ``aux_loss_coeff``), a training forward
keeps its loss (without the coefficient) for the model that runs the layer to take in the same forward
(``take_aux_loss``); the model returns the sum with its output (``models/aux_loss.py``) and the step's
loss weighs it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from torchtitan import compat
from torchtitan.distributed.init_spec import InitSpec, trunc_normal_spec
from torchtitan.models.expert_balance import ExpertLayer
from torchtitan.models.moe.balance import aux_loss
from torchtitan.models.moe.dispatch import AllToAllDispatcher, LocalDispatcher, Routing, combine, permute
from torchtitan.models.moe.experts import GroupedExperts
from torchtitan.models.moe.node_dispatch import NodeDispatcher
from torchtitan.models.moe.router import TokenChoiceRouter, check_routing
from torchtitan.models.moe.tp_grads import call_summing_grads


@dataclass
class MoEArgs:
    """One MoE feed-forward. Qwen3-MoE: softmax, ``norm_topk_prob``; DeepSeek-V3: sigmoid, groups, shared, bias."""

    dim: int
    hidden_dim: int  # per expert (moe_intermediate_size)
    num_experts: int
    top_k: int
    num_shared_experts: int = 0  # a dense SwiGLU of width hidden_dim * num_shared_experts beside the routed ones
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    norm_topk_prob: bool = False
    route_scale: float = 1.0
    num_groups: int = 1  # group-limited routing: experts in num_groups groups, tokens choose in topk_groups
    topk_groups: int = 1
    load_balance_bias: bool = False  # the auxiliary-loss-free bias (expert_balance.update_expert_bias moves it)
    aux_loss: Literal["none", "switch", "sequence"] = "none"
    aux_loss_coeff: float = 0.0
    use_grouped_mm: bool = True
    router_bias: bool = False  # a learned bias on the router's logits (GPT-OSS)
    # Under expert parallelism, run the shared experts while the routed tokens travel (--moe.overlap_all_to_all)
    overlap_all_to_all: bool = True
    # Under expert parallelism across nodes of this many consecutive ranks, the two-hop dispatch
    # (node_dispatch.py; --moe.dispatch_gpus_per_node); 0: one hop
    dispatch_gpus_per_node: int = 0

    def check(self) -> None:
        """ValueError, one line, for options that cannot work."""
        check_routing(self.num_experts, self.top_k, self.score_func, self.num_groups, self.topk_groups)
        if self.aux_loss not in ("none", "switch", "sequence"):
            raise ValueError(f"moe aux_loss={self.aux_loss!r} is unknown; choose none, switch or sequence")
        if self.dispatch_gpus_per_node < 0:
            raise ValueError(f"moe dispatch_gpus_per_node={self.dispatch_gpus_per_node} must be 0 (one hop) or the "
                             "GPUs per node")
        if self.num_shared_experts < 0 or self.hidden_dim < 1 or self.dim < 1:
            raise ValueError(f"moe dim={self.dim}, hidden_dim={self.hidden_dim} and "
                             f"num_shared_experts={self.num_shared_experts} must be positive (shared: or zero)")


class SwiGLU(nn.Module):
    """``w2(silu(w1 x) * w3 x)``: the shared experts.

    ``grad_group``: the TP ranks that feed it different tokens (``parallel.split_over_tp``), over which
    its weights' gradients are summed; None when they feed it the same ones, or without TP.
    """

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.grad_group: dist.ProcessGroup | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.grad_group
        hidden = F.silu(call_summing_grads(self.w1, x, g)) * call_summing_grads(self.w3, x, g)
        return call_summing_grads(self.w2, hidden, g)


class MoE(nn.Module):
    """``forward(x [..., D]) -> [..., D]``; see the module docstring for ``tokens_per_expert``.

    ``dispatcher`` is a ``LocalDispatcher`` (every expert here); ``parallel.apply_expert_parallel``
    shards the experts over an ``ep`` mesh and swaps in an ``AllToAllDispatcher``. ``tp_split``: the TP
    ranks that each route their own sequence shard through it (``parallel.split_over_tp``, when expert
    parallelism borrows TP's ranks); 1 when every TP rank routes the same tokens, or without TP.
    ``take_aux_loss`` hands on the auxiliary loss of the last training forward (see the module docstring).
    """

    tokens_per_expert: torch.Tensor  # a buffer, registered in __init__

    def __init__(self, args: MoEArgs):
        super().__init__()
        args.check()
        self.args = args
        self.router = TokenChoiceRouter(
            args.dim, args.num_experts, args.top_k, args.score_func, args.norm_topk_prob, args.route_scale,
            args.num_groups, args.topk_groups, args.load_balance_bias, gate_bias=args.router_bias)
        self.experts = GroupedExperts(args.dim, args.hidden_dim, args.num_experts, args.use_grouped_mm)
        self.shared_experts = (SwiGLU(args.dim, args.hidden_dim * args.num_shared_experts)
                               if args.num_shared_experts else None)
        self.dispatcher: LocalDispatcher | AllToAllDispatcher | NodeDispatcher = LocalDispatcher(args.num_experts)
        self.tp_split = 1
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts, dtype=torch.int64), persistent=False)
        self._aux_loss: torch.Tensor | None = None  # the last training forward's, until its model takes it

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Zero the counts and the router bias (after ``to_empty``, before a load)."""
        self.tokens_per_expert.zero_()
        if self.router.expert_bias is not None:
            self.router.expert_bias.zero_()

    @property
    def expert_bias(self) -> torch.Tensor | None:
        """The router's auxiliary-loss-free bias [E] (None without ``load_balance_bias``)."""
        return self.router.expert_bias

    def _counting(self) -> bool:
        # A recompute under activation checkpointing runs inside the backward pass; the original
        # forward never does (it may run with grad on or off, so grad mode cannot tell them apart).
        # A pipeline schedule's first step also runs each stage once on stand-in inputs to learn shapes.
        return self.training and not compat.in_backward_pass() and not compat.in_pipeline_shape_inference()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        weights, experts, scores = self.router(tokens)
        if isinstance(self.dispatcher, NodeDispatcher):
            y = self._routed_in_two_hops(tokens, experts, weights, self.dispatcher)
        else:
            y = self._routed(tokens, experts, weights)
        if self.has_aux_loss and self.training:
            sequences = math.prod(shape[:-2]) if len(shape) > 2 else 1
            loss = aux_loss(self.args.aux_loss, scores, experts, sequences)
            # An activation-checkpoint recompute runs the same ops (it must save the same tensors), but its
            # forward's loss was taken already: it keeps nothing.
            if not compat.in_backward_pass():
                self._aux_loss = loss
        return y.view(shape)

    def _count(self, counts: torch.Tensor) -> None:
        if self._counting():
            with torch.no_grad():
                self.tokens_per_expert += counts

    def _routed(self, tokens: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Routed plus shared experts through a one-hop dispatcher (local, or one all-to-all over ``ep``)."""
        assert not isinstance(self.dispatcher, NodeDispatcher)
        routing = self.dispatcher.sort(experts)
        self._count(routing.counts)
        if self._overlaps():
            return self._routed_beside_shared(tokens, routing, weights)
        routed, counts, state = self.dispatcher.exchange(permute(tokens, routing), routing)
        out = self.dispatcher.exchange_back(self.experts(routed, counts), state)
        y = combine(out, routing, weights, tokens.dtype)
        return y if self.shared_experts is None else y + self.shared_experts(tokens)

    def _routed_in_two_hops(self, tokens: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                            dispatcher: NodeDispatcher) -> torch.Tensor:
        """Routed plus shared experts through the two-hop dispatch; with ``overlap_all_to_all`` the shared experts
        run while the first hop's rows cross the network (``node_dispatch.py``)."""
        self._count(dispatcher.count(experts))
        shared_experts = self.shared_experts
        if shared_experts is not None and self.args.overlap_all_to_all:
            y, shared = dispatcher.forward(tokens, experts, weights, self.experts, lambda: shared_experts(tokens))
            assert shared is not None
            return y + shared
        y, _ = dispatcher.forward(tokens, experts, weights, self.experts)
        return y if shared_experts is None else y + shared_experts(tokens)

    def _overlaps(self) -> bool:
        """Whether the shared experts run while the routed tokens travel (``--moe.overlap_all_to_all``)."""
        return (self.args.overlap_all_to_all and self.shared_experts is not None
                and isinstance(self.dispatcher, AllToAllDispatcher))

    def _routed_beside_shared(self, tokens: torch.Tensor, routing: Routing, weights: torch.Tensor) -> torch.Tensor:
        """The routed and shared experts' sum, the shared experts computed between the dispatch's issue and its wait.

        The same ops as the plain path in another order, summed in the same order: the same result, bit for bit.
        In backward, autograd runs the later-created node first: the wait's backward issues the gradient's
        reverse exchange, the shared experts' backward runs, then the issue's backward waits for it.
        """
        assert isinstance(self.dispatcher, AllToAllDispatcher) and self.shared_experts is not None
        pending = self.dispatcher.begin_exchange(permute(tokens, routing), routing)
        shared = self.shared_experts(tokens)
        routed, counts, state = self.dispatcher.end_exchange(pending)
        out = self.dispatcher.exchange_back(self.experts(routed, counts), state)
        return combine(out, routing, weights, tokens.dtype) + shared

    @property
    def has_aux_loss(self) -> bool:
        """Whether training forwards compute an auxiliary balance loss."""
        return self.args.aux_loss != "none" and self.args.aux_loss_coeff > 0

    @property
    def aux_loss_coeff(self) -> float:
        """The auxiliary loss's weight, which the step's loss applies (0 without one)."""
        return self.args.aux_loss_coeff if self.has_aux_loss else 0.0

    def take_aux_loss(self) -> torch.Tensor | None:
        """The auxiliary loss of the last training forward (without its coefficient), once; None: none since."""
        loss, self._aux_loss = self._aux_loss, None
        return loss

    def param_init_specs(self, std: float = 0.02, out_std: float | None = None) -> dict[str, InitSpec]:
        """Name (relative to this module) -> InitSpec: inputs trunc_normal(std), outputs (w2) trunc_normal(out_std).

        Cut at +-2 std, as the dense feed-forward. With ``layout_init`` every parameter's full
        value, stacked experts included, is a function of (seed, name, shape) only: an
        expert-parallel rank draws exactly its experts' rows, so EP 1, 2 and 4 start the same.
        """
        in_spec, out_spec = trunc_normal_spec(std, 2.0), trunc_normal_spec(std if out_std is None else out_std, 2.0)
        specs = {"router.gate.weight": in_spec, "experts.w1": in_spec, "experts.w3": in_spec, "experts.w2": out_spec}
        if self.shared_experts is not None:
            specs.update({"shared_experts.w1.weight": in_spec, "shared_experts.w3.weight": in_spec,
                          "shared_experts.w2.weight": out_spec})
        return specs


def moe_layers(module: nn.Module) -> list[ExpertLayer]:
    """The MoE layers of ``module`` (a model or a pipeline stage of one), in module order."""
    return [m for m in module.modules() if isinstance(m, MoE)]
