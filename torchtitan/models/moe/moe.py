"""The mixture-of-experts feed-forward: router -> routed experts (through a dispatcher) -> + shared experts.

``MoE(MoEArgs)`` replaces a dense feed-forward: ``forward(x [..., D]) -> [..., D]``. It keeps,
for balancing and logging, the (token, slot) pairs each expert received since they were last
consumed, in the non-persistent buffer ``tokens_per_expert [E]`` (int64, this rank's tokens):
counted in training mode only, once per forward (never again in an activation-checkpoint
recompute, nor in a pipeline stage's shape inference), summed over micro-batches until
``models/expert_balance.update_expert_bias`` zeroes them. ``MoE`` is the ``ExpertLayer`` that the
trainer balances (``models/expert_balance.py``); ``moe_layers`` finds them in a model.
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
from torchtitan.models.moe.dispatch import AllToAllDispatcher, LocalDispatcher, combine, permute
from torchtitan.models.moe.experts import GroupedExperts
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

    def check(self) -> None:
        """ValueError, one line, for options that cannot work."""
        check_routing(self.num_experts, self.top_k, self.score_func, self.num_groups, self.topk_groups)
        if self.aux_loss not in ("none", "switch", "sequence"):
            raise ValueError(f"moe aux_loss={self.aux_loss!r} is unknown; choose none, switch or sequence")
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


class _AttachAuxLoss(torch.autograd.Function):
    """Returns ``out``; its backward also gives ``loss`` the gradient ``scale``.

    So an auxiliary loss trains without travelling to the loss function: it works the same
    through pipeline stages and activation checkpointing (the recomputed graph attaches it again).
    """

    @staticmethod
    def forward(ctx, out: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:  # noqa: ANN001
        ctx.scale = scale
        ctx.loss_meta = (loss.shape, loss.dtype, loss.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        shape, dtype, device = ctx.loss_meta
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


class MoE(nn.Module):
    """``forward(x [..., D]) -> [..., D]``; see the module docstring for ``tokens_per_expert``.

    ``dispatcher`` is a ``LocalDispatcher`` (every expert here); ``parallel.apply_expert_parallel``
    shards the experts over an ``ep`` mesh and swaps in an ``AllToAllDispatcher``. ``tp_split``: the TP
    ranks that each route their own sequence shard through it (``parallel.split_over_tp``, when expert
    parallelism borrows TP's ranks); 1 when every TP rank routes the same tokens, or without TP.
    With an auxiliary loss, its gradient is ``aux_loss_coeff * aux_loss_grad_scale``: the trainer
    sets ``aux_loss_grad_scale`` to the factor its main loss is scaled by (1 / micro-batches, ...).
    ``aux_loss_sum`` / ``aux_loss_count`` hold the detached losses of the forwards since ``pop_aux_loss``.
    """

    tokens_per_expert: torch.Tensor  # buffers, registered in __init__
    aux_loss_sum: torch.Tensor

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
        self.dispatcher: LocalDispatcher | AllToAllDispatcher = LocalDispatcher(args.num_experts)
        self.aux_loss_grad_scale = 1.0
        self.tp_split = 1
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts, dtype=torch.int64), persistent=False)
        self.register_buffer("aux_loss_sum", torch.zeros((), dtype=torch.float64), persistent=False)
        self.aux_loss_count = 0

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Zero the counts, the logged auxiliary loss and the router bias (after ``to_empty``, before a load)."""
        self.tokens_per_expert.zero_()
        self.aux_loss_sum.zero_()
        self.aux_loss_count = 0
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
        routing = self.dispatcher.sort(experts)
        counting = self._counting()
        if counting:
            with torch.no_grad():
                self.tokens_per_expert += routing.counts
        routed, counts, state = self.dispatcher.exchange(permute(tokens, routing), routing)
        out = self.dispatcher.exchange_back(self.experts(routed, counts), state)
        y = combine(out, routing, weights, tokens.dtype)
        if self.shared_experts is not None:
            y = y + self.shared_experts(tokens)
        if self.training and self.args.aux_loss != "none" and self.args.aux_loss_coeff:
            sequences = math.prod(shape[:-2]) if len(shape) > 2 else 1
            loss = aux_loss(self.args.aux_loss, scores, experts, sequences)
            if counting:
                self.aux_loss_sum += loss.detach().double()
                self.aux_loss_count += 1
            if torch.is_grad_enabled():
                # Split over TP, each rank's loss is one of tp (its shard's), and the router's gradient is
                # summed over them: 1 / tp makes that sum their mean, as a data-parallel average would.
                scale = self.args.aux_loss_coeff * self.aux_loss_grad_scale / self.tp_split
                y = _AttachAuxLoss.apply(y, loss, scale)
        return y.view(shape)

    def pop_aux_loss(self) -> float | None:
        """The mean auxiliary loss of the forwards since the last call (None without one); resets it."""
        if not self.aux_loss_count:
            return None
        value = float(self.aux_loss_sum) / self.aux_loss_count
        self.aux_loss_sum.zero_()
        self.aux_loss_count = 0
        return value

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
