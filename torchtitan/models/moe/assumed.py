"""Dispatchers on assumed token counts: a MoE layer in the planner's dry run (``ModelSpec.assume_routing``).

A MoE layer reads its token counts on the host to size its all-to-all and, where it runs the exact
per-expert loop, its matmuls (``dispatch.py``, ``experts.py``); fake tensors have shapes and no values.
``assume_routing`` swaps each layer's dispatcher for one that assumes the counts (balanced, or the
simulated rank's experts ``imbalance`` times the mean: ``planning/moe.py`` says what and why) and runs
everything else as the real one does: the permutation, the count exchange, the row exchange on ``ep``,
the regrouping, the experts, the way back, the combine.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from torchtitan import compat
from torchtitan.models.moe.dispatch import AllToAllDispatcher, LocalDispatcher, Routing, exchange_rows
from torchtitan.models.moe.moe import MoE
from torchtitan.models.moe.node_dispatch import NodeDispatcher, nodes_per_token


def even_split(total: int, parts: int) -> list[int]:
    """``total`` rows in ``parts`` parts as even as integers allow (the first ones take the remainder)."""
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


def _host(values: list[int], shape: tuple[int, ...]) -> torch.Tensor:
    """Counts as a real tensor, readable on the host inside the fake-tensor trace (``.tolist()``)."""
    with compat.unset_fake_temporarily():
        return torch.tensor(values, dtype=torch.int64).view(shape)


def _sort(experts: torch.Tensor, counts: list[int]) -> Routing:
    """The routing's sort as the real one runs it, with assumed counts (``bincount`` needs values)."""
    order = torch.argsort(experts.reshape(-1), stable=True)
    return Routing(order, _host(counts, (len(counts),)), experts.shape[0], experts.shape[1])


class AssumedLocalDispatcher(LocalDispatcher):
    """EP 1: every expert here, ``T x top_k / E`` rows each."""

    def sort(self, experts: torch.Tensor) -> Routing:
        return _sort(experts, even_split(experts.numel(), self.num_experts))


class AssumedAllToAllDispatcher(AllToAllDispatcher):
    """EP > 1 over the real dispatcher's group, with the simulated rank's experts ``imbalance`` times the mean."""

    def __init__(self, real: AllToAllDispatcher, imbalance: float):
        super().__init__(real.num_experts, real.group)
        self.imbalance = imbalance

    def _plan(self, rows: int) -> tuple[list[int], list[int]]:
        """(rows sent to each EP rank, rows received from each) for ``rows`` local (token, slot) pairs."""
        me = dist.get_rank(self.group)
        from_each = min(rows, round(self.imbalance * rows / self.ep))
        sent = [0] * self.ep
        others = even_split(rows - from_each, self.ep - 1)
        for r in range(self.ep):
            sent[r] = from_each if r == me else others[r - (r > me)]
        return sent, [from_each] * self.ep

    def sort(self, experts: torch.Tensor) -> Routing:
        sent, _ = self._plan(experts.numel())
        return _sort(experts, [n for rank_rows in sent for n in even_split(rank_rows, self.num_local_experts)])

    def exchange_counts(self, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
        equal = [self.num_local_experts] * self.ep
        exchange_rows(counts, equal, equal, self.group)  # the count exchange, as the real one
        sent, received = self._plan(sum(counts.tolist()))  # counts: this rank's, from sort (on the host)
        per_expert = [even_split(n, self.num_local_experts) for n in received]
        by_rank = _host([n for row in per_expert for n in row], (self.ep, self.num_local_experts))
        local = _host([sum(col) for col in zip(*per_expert, strict=True)], (self.num_local_experts,))
        return by_rank, local, received, sent


class AssumedNodeDispatcher(NodeDispatcher):
    """The two-hop dispatch with each token sent to ``nodes_per_token`` nodes (``node_dispatch.nodes_per_token``),
    spread evenly; each relay gets as many of its node's slots as its rank routed (``T x top_k``: every rank routes
    alike), its hop-2 exchange the one-hop assumption over the node's ranks (``imbalance`` included)."""

    def __init__(self, real: NodeDispatcher, imbalance: float, per_token: float):
        super().__init__(real.num_experts, real.inter, real.inner.group)
        self.inner = AssumedAllToAllDispatcher(real.inner, imbalance)
        self.per_token = per_token
        self._slots = 0  # the routing's T x top_k, from the pairs to the relay of the same forward

    def count(self, experts: torch.Tensor) -> torch.Tensor:
        return _host(even_split(experts.numel(), self.num_experts), (self.num_experts,))

    def _node_pairs(self, experts: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        self._slots = experts.numel()
        pairs = round(experts.shape[0] * self.per_token)
        return experts.new_zeros(pairs), even_split(pairs, self.nodes)

    def _exchange_pair_counts(self, per_node: list[int], device: torch.device) -> list[int]:
        exchange_rows(torch.zeros(self.nodes, dtype=torch.int64, device=device), [1] * self.nodes, [1] * self.nodes,
                      self.inter)  # the count exchange, as the real one
        return per_node  # every rank sends alike: as many received from each node as sent to it

    def _relay_sort(self, experts: torch.Tensor) -> tuple[Routing, list[int]]:
        order = torch.argsort(experts.reshape(-1), stable=True)[: self._slots]
        counts = _host(even_split(self._slots, self.experts_per_node), (self.experts_per_node,))
        return (Routing(order, counts, experts.shape[0], experts.shape[1]),
                even_split(self._slots, experts.shape[1]))


def assume_routing(module: nn.Module, imbalance: float) -> int:
    """Give every MoE layer of ``module`` (a model part) an assumed-routing dispatcher; the number changed.

    ``imbalance`` (at least 1: the planner checks it) is the simulated rank's factor (module docstring).
    """
    n = 0
    for m in module.modules():
        if isinstance(m, MoE):
            real = m.dispatcher
            if isinstance(real, NodeDispatcher):
                a = m.args
                per_token = nodes_per_token(a.num_experts, a.top_k, real.nodes, a.num_groups, a.topk_groups)
                m.dispatcher = AssumedNodeDispatcher(real, imbalance, per_token)
            else:
                m.dispatcher = (AssumedAllToAllDispatcher(real, imbalance) if isinstance(real, AllToAllDispatcher)
                                else AssumedLocalDispatcher(real.num_experts))
            n += 1
    return n
