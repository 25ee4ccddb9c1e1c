"""Two-hop expert dispatch for expert parallelism across nodes: each token crosses the network once per node.

``AllToAllDispatcher`` sends a token once per chosen expert: at top-8 over 8 nodes, about 7 of its 8 copies cross
the network, and the network is an eighth of NVLink's bandwidth. ``NodeDispatcher`` sends each token once to each
node that holds one of its experts (hop 1, between the ranks of the same local index on every node), then forwards
it inside the node to the ranks that hold those experts (hop 2, over the node's own ranks, the plain
``AllToAllDispatcher`` on node-local expert ids). On the way back the relay (the hop-1 receiver) sums its node's
weighted expert outputs for each token, so each token again crosses once per node; the source adds the nodes'
partial sums. With DeepSeek-V3's group-limited routing (8 groups of experts, each token in at most 4), when the
groups are the nodes, a token crosses to at most 4 nodes instead of sending 7 copies.

The result is the same sum over the same slots as the one-hop dispatcher, grouped by node: within a node in slot
order, then over the nodes in node order, in float32 both, the partial sums rounded to the activations' dtype for
their trip back. So the layouts agree to rounding, not bit for bit (``tests/distributed/test_moe_node_dispatch.py``).
No ``index_add`` has a repeated index: each sum adds one slot (or one node) at a time into distinct rows.

The sizes of every exchange are read on the host, as in ``dispatch.py``; the planner's dry run, which has no values,
overrides ``_node_pairs`` and ``_relay_sort`` with assumed sizes (``assumed.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from torchtitan.models.moe.dispatch import (
    AllToAllDispatcher,
    Routing,
    _IssueAllToAll,
    _ReverseInFlight,
    _WaitAllToAll,
    all_to_all_rows,
    exchange_rows,
    permute,
)

RunExperts = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (rows grouped by local expert, counts) -> out


class NodeDispatcher:
    """Expert parallelism over ``nodes`` nodes of ``ranks_per_node`` EP ranks each (EP rank ``r`` on node
    ``r // ranks_per_node``): hop 1 over ``inter`` (this rank's peers of the same local index, one per node),
    hop 2 over ``intra`` (this node's EP ranks)."""

    def __init__(self, num_experts: int, inter: dist.ProcessGroup, intra: dist.ProcessGroup):
        self.inter, self.nodes = inter, dist.get_world_size(inter)
        self.inner = AllToAllDispatcher(num_experts // self.nodes, intra)
        self.num_experts = num_experts
        self.experts_per_node = num_experts // self.nodes
        self.num_local_experts = self.inner.num_local_experts

    def count(self, experts: torch.Tensor) -> torch.Tensor:
        """(token, slot) pairs per global expert, this rank's (``MoE.tokens_per_expert``)."""
        return torch.bincount(experts.reshape(-1), minlength=self.num_experts)

    def forward(self, tokens: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, run: RunExperts,
                beside: Callable[[], torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(sum_j weights[t, j] * expert_j(tokens[t]) [T, D], beside's output)``; ``beside`` (the shared experts)
        runs while hop 1's rows travel, forward and backward, as ``MoE``'s overlap does on one hop."""
        pair_index, per_node = self._node_pairs(experts)
        received_per_node = self._exchange_pair_counts(per_node, tokens.device)
        # The small exchanges first: on one communicator the collectives run in the order issued, so the rows,
        # issued last, are the only one in flight while ``beside`` runs.
        relay_experts = exchange_rows(self._pair_experts(experts, pair_index), received_per_node, per_node,
                                      self.inter)
        relay_weights = all_to_all_rows(_gather_pairs(weights, pair_index, self.nodes), received_per_node, per_node,
                                        self.inter)
        reverse = _ReverseInFlight()
        in_flight = _IssueAllToAll.apply(_gather_pairs(tokens, pair_index, self.nodes), received_per_node, per_node,
                                         self.inter, reverse)
        shared = beside() if beside is not None else None
        relay_rows = _WaitAllToAll.apply(in_flight, received_per_node, per_node, self.inter, reverse)
        partial = self._relay(relay_rows, relay_experts, relay_weights, run)
        back = all_to_all_rows(partial, per_node, received_per_node, self.inter)
        return _sum_over_nodes(back, pair_index, per_node, self.nodes, tokens.shape[0]), shared

    def _exchange_pair_counts(self, per_node: list[int], device: torch.device) -> list[int]:
        """The pairs sent to each node exchanged for those received from each (read on the host)."""
        return exchange_rows(torch.tensor(per_node, dtype=torch.int64, device=device), [1] * self.nodes,
                             [1] * self.nodes, self.inter).tolist()

    def _pair_experts(self, experts: torch.Tensor, pair_index: torch.Tensor) -> torch.Tensor:
        """Each pair's k experts as ids local to the pair's node; the sentinel ``experts_per_node`` for a slot whose
        expert is on another node (the relay skips it)."""
        node_of_expert = torch.div(experts, self.experts_per_node, rounding_mode="floor")
        local = _gather_pairs(experts - node_of_expert * self.experts_per_node, pair_index, self.nodes)
        on_pair_node = _gather_pairs(node_of_expert, pair_index, self.nodes) == (pair_index % self.nodes).unsqueeze(1)
        return torch.where(on_pair_node, local, self.experts_per_node)

    def _relay(self, rows: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, run: RunExperts) -> torch.Tensor:
        """This node's weighted expert outputs for each received row, summed in slot order: ``[R, D]``."""
        routing, slot_counts = self._relay_sort(experts)
        routed, counts, state = self.inner.exchange(permute(rows, routing), routing)
        out = self.inner.exchange_back(run(routed, counts), state)
        return _slot_sum(out, routing, weights, slot_counts, rows.dtype)

    def _node_pairs(self, experts: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """``(token * nodes + node for each (token, node) pair the routing needs, node-major; pairs per node)``."""
        node_of_expert = torch.div(experts, self.experts_per_node, rounding_mode="floor")
        needs = torch.zeros(experts.shape[0], self.nodes, dtype=torch.bool, device=experts.device)
        needs.scatter_(1, node_of_expert, True)
        node, token = needs.t().nonzero(as_tuple=True)  # node-major, tokens ascending within a node
        return token * self.nodes + node, needs.sum(dim=0).tolist()

    def _relay_sort(self, experts: torch.Tensor) -> tuple[Routing, list[int]]:
        """The received slots of this node's experts sorted by expert (the sentinel's dropped); their count per slot."""
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.experts_per_node + 1)
        valid = int(counts[: self.experts_per_node].sum())
        slot_counts = torch.bincount(order[:valid] % experts.shape[1], minlength=experts.shape[1]).tolist()
        return Routing(order[:valid], counts[: self.experts_per_node], experts.shape[0], experts.shape[1]), slot_counts


def _gather_pairs(x: torch.Tensor, pair_index: torch.Tensor, nodes: int) -> torch.Tensor:
    """``x[token]`` for each pair. Through a ``[T * nodes, ...]`` view, so that each row is read once and the
    backward writes distinct rows and sums over the nodes by a reduction (no repeated index)."""
    wide = x.unsqueeze(1).expand(x.shape[0], nodes, *x.shape[1:]).reshape(x.shape[0] * nodes, *x.shape[1:])
    return wide.index_select(0, pair_index)


def _slot_sum(out: torch.Tensor, routing: Routing, weights: torch.Tensor, slot_counts: list[int],
              dtype: torch.dtype) -> torch.Tensor:
    """``sum_j weights[r, j] * out(r, j)`` over row ``r``'s slots present here, slot by slot in float32, as ``[R, D]``.

    ``out`` is expert-major (``routing.order``); it is regrouped slot-major once, then each slot's rows are added
    into their distinct rows of the sum.
    """
    slot = routing.order % routing.top_k
    by_slot = torch.argsort(slot, stable=True)
    flat = routing.order.index_select(0, by_slot)
    rows, w = flat // routing.top_k, weights.reshape(-1).index_select(0, flat).float()
    total = out.new_zeros(routing.num_tokens, out.shape[-1], dtype=torch.float32)
    chunks = zip(out.index_select(0, by_slot).split(slot_counts), rows.split(slot_counts), w.split(slot_counts),
                 strict=True)
    for chunk, chunk_rows, chunk_w in chunks:
        total = total.index_add(0, chunk_rows, chunk.float() * chunk_w.unsqueeze(1))
    return total.to(dtype)


def _sum_over_nodes(back: torch.Tensor, pair_index: torch.Tensor, per_node: list[int], nodes: int,
                    num_tokens: int) -> torch.Tensor:
    """The nodes' partial sums of each token added in node order, in float32: ``[T, D]``."""
    total = back.new_zeros(num_tokens, back.shape[-1], dtype=torch.float32)
    for chunk, tokens in zip(back.split(per_node), (pair_index // nodes).split(per_node), strict=True):
        total = total.index_add(0, tokens, chunk.float())
    return total.to(back.dtype)


def nodes_per_token(num_experts: int, top_k: int, nodes: int, num_groups: int, topk_groups: int) -> float:
    """How many nodes a token's experts span, on average, under balanced routing: the planner's assumption.

    Uniform over the experts: ``nodes * (1 - C(E - E/nodes, k) / C(E, k))``. With group-limited routing whose groups
    each sit in one node (groups a multiple of nodes), over the chosen groups instead: a token's experts lie in its
    ``topk_groups`` groups, taken as spread over distinct groups' nodes the same way.
    """
    if num_groups > 1 and num_groups % nodes == 0:
        units, chosen = num_groups, topk_groups
    else:
        units, chosen = num_experts, top_k
    return nodes * (1 - math.comb(units - units // nodes, chosen) / math.comb(units, chosen))
