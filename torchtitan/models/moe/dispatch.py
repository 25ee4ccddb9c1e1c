"""Dropless token dispatch: tokens to their experts and back, deterministic in every step.

A step of the MoE feed-forward, for ``T`` tokens each routed to ``k`` experts:

1. ``sort_by_expert``: a stable sort of the ``T*k`` (token, slot) pairs by expert, and the
   number of pairs per expert (``bincount``: no ``histc``, no atomics);
2. ``permute``: the tokens gathered in that order (expert-major rows);
3. a dispatcher's ``exchange``: ``LocalDispatcher`` keeps them (every expert here);
   ``AllToAllDispatcher`` sends each expert's rows to the rank that holds it (or, in two halves,
   ``begin_exchange`` and ``end_exchange``, so that other work runs while the rows travel);
4. the experts, grouped by local expert;
5. the dispatcher's ``exchange_back``, the inverse of 3;
6. ``combine``: rows back to (token, slot) order by a gather, then the weighted sum over
   the k slots in slot order in float32. No ``scatter_add``/``index_add`` with repeated
   indices, whose order of addition is not fixed on accelerators.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from torchtitan.distributed.group_labels import way_back


@dataclass
class Routing:
    """The local sort of one forward: ``order[i]`` is the flat (token * k + slot) of sorted row ``i``."""

    order: torch.Tensor  # [T*k] int64
    counts: torch.Tensor  # [E] int64: this rank's (token, slot) pairs per global expert
    num_tokens: int
    top_k: int


def sort_by_expert(experts: torch.Tensor, num_experts: int) -> Routing:
    """Sort the (token, slot) pairs of ``experts [T, k]`` by expert, keeping token order within one."""
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return Routing(order, counts, experts.shape[0], experts.shape[1])


def permute(x: torch.Tensor, routing: Routing) -> torch.Tensor:
    """``x [T, D]`` -> ``[T*k, D]`` in expert-major order.

    Each token is first repeated k times, so the gather reads every row once: its backward
    writes each row once and the k copies are summed by a plain reduction, in a fixed order.
    """
    repeated = x.unsqueeze(1).expand(-1, routing.top_k, -1).reshape(-1, x.shape[-1])
    return repeated.index_select(0, routing.order)


def combine(out: torch.Tensor, routing: Routing, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Expert outputs ``[T*k, D]`` (expert-major) -> ``sum_j weights[t, j] * out(t, j)`` as ``[T, D]``."""
    inverse = torch.empty_like(routing.order)
    inverse[routing.order] = torch.arange(routing.order.numel(), device=routing.order.device)
    slots = out.index_select(0, inverse).view(routing.num_tokens, routing.top_k, -1)
    return _WeightedSlotSum.apply(slots, weights, dtype)


class _WeightedSlotSum(torch.autograd.Function):
    """``sum_j weights[:, j] * slots[:, j]`` in float32, slot by slot (the same sum on every layout and device).

    Its own backward because autograd's, through the k slot selections, writes a zero-filled float32
    ``[T, k, D]`` per slot and adds the k of them up: O(k^2) memory traffic, which was DeepSeek-V3's
    largest memory-bound cost (k = 8). Here the slots' gradient is one product, the weights' one
    product and one reduction over D, the same values as autograd's; and the slots are kept in their
    own dtype (bf16 under mixed precision), not as the float32 copy.
    """

    @staticmethod
    def forward(ctx, slots: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(slots, weights)
        wide, w = slots.float(), weights.float()
        total = wide[:, 0] * w[:, :1]
        for slot in range(1, slots.shape[1]):
            total = total + wide[:, slot] * w[:, slot : slot + 1]
        return total.to(dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        slots, weights = ctx.saved_tensors
        g = grad.float().unsqueeze(1)
        grad_slots = (g * weights.float().unsqueeze(-1)).to(slots.dtype)
        grad_weights = (g * slots.float()).sum(-1).to(weights.dtype)
        return grad_slots, grad_weights, None


class LocalDispatcher:
    """Expert parallelism 1: every expert is here, the sorted rows are the experts' input."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.num_local_experts = num_experts

    def sort(self, experts: torch.Tensor) -> Routing:
        """This forward's ``Routing`` (the planner's dry run, which cannot count fake tensors, overrides it)."""
        return sort_by_expert(experts, self.num_experts)

    def exchange(self, routed: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """``(rows for the local experts grouped by expert, counts per local expert, state for exchange_back)``."""
        return routed, routing.counts, None

    def exchange_back(self, out: torch.Tensor, state: Any) -> torch.Tensor:
        return out


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows with uneven splits; its backward is the exchange in reverse."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int],  # noqa: ANN001
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return exchange_rows(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        out_splits, in_splits = ctx.splits
        return exchange_rows(grad, in_splits, out_splits, ctx.group), None, None, None


def exchange_rows(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                  group: dist.ProcessGroup) -> torch.Tensor:
    """The functional (out-of-place) collective, not ``dist.all_to_all_single``'s in-place one: selective
    activation checkpointing (distributed/activation_checkpoint.py) can keep its output, so a block's
    recompute reuses the tokens received instead of sending them again."""
    out = torch.ops._c10d_functional.all_to_all_single(x.contiguous(), out_splits, in_splits, group.group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


def all_to_all_rows(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                    group: dist.ProcessGroup) -> torch.Tensor:
    """Send ``in_splits[r]`` rows of ``x`` to rank ``r``, receive ``out_splits[r]`` from it (differentiable)."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


def issue_rows(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """``exchange_rows`` without its wait: the output may be read only after ``wait_tensor`` on it."""
    return torch.ops._c10d_functional.all_to_all_single(x.contiguous(), out_splits, in_splits, group.group_name)


class _ReverseInFlight:
    """The gradient's reverse exchange between the backwards of ``_WaitAllToAll`` (which issues it) and
    ``_IssueAllToAll`` (which waits for it): autograd hands a gradient of the received rows' shape between them."""

    def __init__(self) -> None:
        self.grad: torch.Tensor | None = None


class _IssueAllToAll(torch.autograd.Function):
    """The first half of ``_AllToAll``: the rows exchange issued, its output not yet waited for.

    Backward: the wait for the reverse exchange of the gradient, which ``_WaitAllToAll``'s backward issued.
    Autograd's CPU ready queue runs the node created later in forward first, so the nodes created
    between the two halves (the shared experts') run their backward between that issue and this wait.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int],  # noqa: ANN001
                group: dist.ProcessGroup, reverse: _ReverseInFlight) -> torch.Tensor:
        ctx.reverse = reverse
        return issue_rows(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        in_flight, ctx.reverse.grad = ctx.reverse.grad, None
        assert in_flight is not None, "the wait's backward issues the reverse exchange first"
        return torch.ops._c10d_functional.wait_tensor(in_flight), None, None, None, None


class _WaitAllToAll(torch.autograd.Function):
    """The second half of ``_AllToAll``: the wait for the rows; backward issues the gradient's reverse exchange
    (and passes the gradient on unchanged, for ``_IssueAllToAll``'s backward to wait for the exchange instead)."""

    @staticmethod
    def forward(ctx, in_flight: torch.Tensor, out_splits: list[int], in_splits: list[int],  # noqa: ANN001
                group: dist.ProcessGroup, reverse: _ReverseInFlight) -> torch.Tensor:
        ctx.splits, ctx.group, ctx.reverse = (out_splits, in_splits), group, reverse
        return torch.ops._c10d_functional.wait_tensor(in_flight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        out_splits, in_splits = ctx.splits
        ctx.reverse.grad = issue_rows(grad, in_splits, out_splits, ctx.group)
        return grad, None, None, None, None


@dataclass
class PendingExchange:
    """An exchange between its halves: the rows (in flight until ``end_exchange``) and the counts already read."""

    rows: torch.Tensor
    reverse: _ReverseInFlight
    by_rank: torch.Tensor  # [ep, E/ep]: rows from each rank per local expert
    local_counts: torch.Tensor  # [E/ep]
    out_splits: list[int]
    in_splits: list[int]


@dataclass
class _Exchanged:
    to_expert_major: torch.Tensor  # [M]: received (rank-major) row of each expert-major row
    out_splits: list[int]
    in_splits: list[int]


class AllToAllDispatcher:
    """Expert parallelism over ``group``: rank ``r`` of ``ep`` holds experts ``[r*E/ep, (r+1)*E/ep)``.

    The exchange sends each rank's sorted rows to the experts' ranks (counts first, then rows,
    both with ``all_to_all_single``: gloo has no uneven list all-to-all), then regroups the
    received rows from rank-major (source rank, expert) to expert-major (expert, source rank).
    """

    def __init__(self, num_experts: int, group: dist.ProcessGroup):
        self.group = group
        self.ep = dist.get_world_size(group)
        if num_experts % self.ep:
            raise ValueError(f"moe num_experts={num_experts} is not divisible by the expert-parallel degree {self.ep}")
        self.num_experts, self.num_local_experts = num_experts, num_experts // self.ep

    def sort(self, experts: torch.Tensor) -> Routing:
        """This forward's ``Routing`` (the planner's dry run, which cannot count fake tensors, overrides it)."""
        return sort_by_expert(experts, self.num_experts)

    def exchange_counts(self, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
        """``(rows from each rank per local expert [ep, E/ep], rows per local expert [E/ep], rows received
        from each rank, rows sent to each rank)``: the counts exchanged, the split sizes read on the host."""
        equal = [self.num_local_experts] * self.ep  # E/ep counts to each rank
        received_counts = exchange_rows(counts, equal, equal, self.group)
        by_rank = received_counts.view(self.ep, self.num_local_experts)  # [source rank, local expert]
        in_splits = counts.view(self.ep, self.num_local_experts).sum(dim=1).tolist()
        out_splits = by_rank.sum(dim=1).tolist()
        return by_rank, by_rank.sum(dim=0), out_splits, in_splits

    def exchange(self, routed: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, _Exchanged]:
        by_rank, local_counts, out_splits, in_splits = self.exchange_counts(routing.counts)
        received = all_to_all_rows(routed, out_splits, in_splits, self.group)
        return self._regroup(received, by_rank, local_counts, out_splits, in_splits)

    def begin_exchange(self, routed: torch.Tensor, routing: Routing) -> PendingExchange:
        """``exchange`` up to the rows issued: the counts are exchanged (and read on the host), the rows travel."""
        by_rank, local_counts, out_splits, in_splits = self.exchange_counts(routing.counts)
        reverse = _ReverseInFlight()
        in_flight = _IssueAllToAll.apply(routed, out_splits, in_splits, self.group, reverse)
        return PendingExchange(in_flight, reverse, by_rank, local_counts, out_splits, in_splits)

    def end_exchange(self, pending: PendingExchange) -> tuple[torch.Tensor, torch.Tensor, _Exchanged]:
        """The rest of ``exchange``: the wait for the rows, then the regrouping; the same ops and result."""
        received = _WaitAllToAll.apply(pending.rows, pending.out_splits, pending.in_splits, self.group,
                                       pending.reverse)
        return self._regroup(received, pending.by_rank, pending.local_counts, pending.out_splits, pending.in_splits)

    def _regroup(self, received: torch.Tensor, by_rank: torch.Tensor, local_counts: torch.Tensor,
                 out_splits: list[int], in_splits: list[int]) -> tuple[torch.Tensor, torch.Tensor, _Exchanged]:
        """The received rows from rank-major to expert-major order, with what ``exchange_back`` needs."""
        segment = torch.repeat_interleave(torch.arange(by_rank.numel(), device=received.device), by_rank.reshape(-1),
                                          output_size=sum(out_splits))  # known: no second read of the counts
        expert_major_key = (segment % self.num_local_experts) * self.ep + segment // self.num_local_experts
        to_expert_major = torch.argsort(expert_major_key, stable=True)
        state = _Exchanged(to_expert_major, out_splits, in_splits)
        return received.index_select(0, to_expert_major), local_counts, state

    def exchange_back(self, out: torch.Tensor, state: _Exchanged) -> torch.Tensor:
        back = torch.empty_like(state.to_expert_major)
        back[state.to_expert_major] = torch.arange(back.numel(), device=back.device)
        rank_major = out.index_select(0, back)
        with way_back():
            return all_to_all_rows(rank_major, state.in_splits, state.out_splits, self.group)
