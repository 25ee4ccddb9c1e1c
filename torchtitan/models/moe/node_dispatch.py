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
their trip back. So the layouts agree to rounding, not bit for bit (``tests/distributed/test_moe_expert_parallel.py``).
No ``index_add`` has a repeated index: each sum adds one slot (or one node) at a time into distinct rows.

The sizes of every exchange are read on the host, as in ``dispatch.py``; the planner's dry run, which has no values,
overrides ``_node_pairs`` and ``_relay_sort`` with assumed sizes (``assumed.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from torchtitan.distributed.group_labels import way_back
from torchtitan.models.moe.dispatch import (
    AllToAllDispatcher,
    Routing,
    _IssueAllToAll,
    _ReverseInFlight,
    _WaitAllToAll,
    all_to_all_rows,
    exchange_rows,
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
        pair_tokens = torch.div(pair_index, self.nodes, rounding_mode="floor")
        received_per_node = self._exchange_pair_counts(per_node, tokens.device)
        # The small exchanges first: on one communicator the collectives run in the order issued, so the rows,
        # issued last, are the only one in flight while ``beside`` runs.
        relay_experts = exchange_rows(self._pair_experts(experts, pair_index), received_per_node, per_node,
                                      self.inter)
        relay_weights = all_to_all_rows(gather_in_chunks(weights, pair_tokens, per_node), received_per_node,
                                        per_node, self.inter)
        reverse = _ReverseInFlight()
        in_flight = _IssueAllToAll.apply(gather_in_chunks(tokens, pair_tokens, per_node), received_per_node, per_node,
                                         self.inter, reverse)
        shared = beside() if beside is not None else None
        relay_rows = _WaitAllToAll.apply(in_flight, received_per_node, per_node, self.inter, reverse)
        partial = self._relay(relay_rows, relay_experts, relay_weights, run)
        with way_back():
            back = all_to_all_rows(partial, per_node, received_per_node, self.inter)
        return add_in_chunks(back, pair_tokens, per_node, tokens.shape[0]).to(tokens.dtype), shared

    def _exchange_pair_counts(self, per_node: list[int], device: torch.device) -> list[int]:
        """The pairs sent to each node exchanged for those received from each (read on the host)."""
        return exchange_rows(torch.tensor(per_node, dtype=torch.int64, device=device), [1] * self.nodes,
                             [1] * self.nodes, self.inter).tolist()

    def _pair_experts(self, experts: torch.Tensor, pair_index: torch.Tensor) -> torch.Tensor:
        """Each pair's k experts as ids local to the pair's node; the sentinel ``experts_per_node`` for a slot whose
        expert is on another node (the relay skips it)."""
        pair_experts = experts.index_select(0, torch.div(pair_index, self.nodes, rounding_mode="floor"))
        pair_node = (pair_index % self.nodes).unsqueeze(1)
        node_of_expert = torch.div(pair_experts, self.experts_per_node, rounding_mode="floor")
        return torch.where(node_of_expert == pair_node, pair_experts - pair_node * self.experts_per_node,
                           self.experts_per_node)

    def _relay(self, rows: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, run: RunExperts) -> torch.Tensor:
        """This node's weighted expert outputs for each received row, summed in slot order: ``[R, D]``."""
        routing, slot_counts = self._relay_sort(experts)
        # Slot-major: within one slot each row appears once, so the gather's backward and the sum add distinct rows.
        by_slot = torch.argsort(routing.order % routing.top_k, stable=True)
        flat = routing.order.index_select(0, by_slot)  # row * top_k + slot, slot-major
        slot_rows = torch.div(flat, routing.top_k, rounding_mode="floor")
        to_expert_major = torch.empty_like(by_slot)
        to_expert_major[by_slot] = torch.arange(by_slot.numel(), device=by_slot.device)
        routed = gather_in_chunks(rows, slot_rows, slot_counts).index_select(0, to_expert_major)
        routed, counts, state = self.inner.exchange(routed, routing)
        out = self.inner.exchange_back(run(routed, counts), state).index_select(0, by_slot)
        weighted = out.float() * weights.reshape(-1).index_select(0, flat).float().unsqueeze(1)
        return add_in_chunks(weighted, slot_rows, slot_counts, rows.shape[0]).to(rows.dtype)

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


class _GatherInChunks(torch.autograd.Function):
    """``x.index_select(0, index)``; backward: the rows' gradients added chunk by chunk in float32, each chunk's
    ``index`` distinct, so no ``index_add`` has a repeated index (the order of addition is the chunks' order)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, chunks: list[int]) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(index)
        ctx.chunks, ctx.rows = chunks, x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        (index,) = ctx.saved_tensors
        return _add_rows(grad, index, ctx.chunks, ctx.rows).to(grad.dtype), None, None


def gather_in_chunks(x: torch.Tensor, index: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """``x[index]`` where ``index`` splits into ``chunks`` of distinct values (differentiable, deterministic)."""
    return _GatherInChunks.apply(x, index, chunks)


def _add_rows(x: torch.Tensor, index: torch.Tensor, chunks: list[int], rows: int) -> torch.Tensor:
    total = x.new_zeros(rows, *x.shape[1:], dtype=torch.float32)
    for part, part_index in zip(x.split(chunks), index.split(chunks), strict=True):
        total.index_add_(0, part_index, part.float())
    return total


class _AddInChunks(torch.autograd.Function):
    """``_add_rows``; backward: one gather of the sum's gradient (its adjoint), in ``x``'s dtype."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, chunks: list[int], rows: int) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(index)
        ctx.dtype = x.dtype
        return _add_rows(x, index, chunks, rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        (index,) = ctx.saved_tensors
        return grad.index_select(0, index).to(ctx.dtype), None, None, None


def add_in_chunks(x: torch.Tensor, index: torch.Tensor, chunks: list[int], rows: int) -> torch.Tensor:
    """``out[index[i]] += x[i]`` into ``rows`` zero rows of float32, chunk by chunk (each chunk's ``index``
    distinct, so the order of addition is the chunks'), in place: a GPU's kernel touches only the indexed rows."""
    return _AddInChunks.apply(x, index, chunks, rows)


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
