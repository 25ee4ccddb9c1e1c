"""Bytes the expert-parallel all-to-all moves: the formula a planner prices, and the exact count of one routing.

Per MoE layer, per rank, per forward + backward under ``AllToAllDispatcher`` (``dispatch.py``), counting
only what goes to other ranks (``all_to_all_single`` copies a rank's own rows locally):

- forward dispatch: the rank's (token, slot) rows whose expert lives on another rank, ``dim`` values each;
- forward combine: the rows it received from other ranks, sent back to them;
- backward: the gradients of both exchanges, the same sizes in the other direction
  (the combine's gradient follows the dispatch's splits, the dispatch's the combine's);
- the count exchange before the dispatch: ``E / ep`` int64 counts to each other rank, forward only
  (the counts are not differentiated).

A recompute under activation checkpointing runs the forward's three exchanges again. A step moves
this times the MoE layers of a stage times its micro-batches.
"""

from __future__ import annotations

from collections.abc import Sequence

COUNT_BYTES = 8  # the token counts travel as int64


def all_to_all_bytes(tokens: int, top_k: int, dim: int, ep: int, dtype_bytes: int, num_experts: int = 0,
                     recompute: bool = False) -> float:
    """Expected bytes one rank sends to other ranks per forward + backward of one MoE layer.

    ``tokens`` per rank, each routed to ``top_k`` experts, rows of ``dim`` values of ``dtype_bytes``,
    expert-parallel degree ``ep``. Uniform routing: a (token, slot) pair's expert sits on another
    rank with probability ``(ep - 1) / ep``, and a rank receives as many rows as it sends. So each
    of the four exchanges moves ``tokens * top_k * (ep - 1) / ep`` rows; ``recompute`` adds the
    forward's two again. ``num_experts`` adds the count exchange (left out at 0).
    """
    if min(tokens, top_k, dim, ep, dtype_bytes) < 0 or ep < 1 or num_experts < 0:
        raise ValueError(f"all_to_all_bytes: tokens={tokens}, top_k={top_k}, dim={dim}, dtype_bytes={dtype_bytes} "
                         f"and num_experts={num_experts} must be >= 0 and ep={ep} >= 1")
    forwards = 2 if recompute else 1
    rows = (2 * forwards + 2) * tokens * top_k * (ep - 1) / ep
    counts = forwards * num_experts * (ep - 1) / ep
    return rows * dim * dtype_bytes + counts * COUNT_BYTES


def exact_all_to_all_bytes(counts_by_rank: Sequence[Sequence[int]], rank: int, dim: int, dtype_bytes: int,
                           recompute: bool = False) -> int:
    """Bytes ``rank`` sends to other ranks per forward + backward of one MoE layer, for one routing.

    ``counts_by_rank[r][e]``: the (token, slot) pairs of rank ``r`` routed to global expert ``e``
    (``MoE.tokens_per_expert`` of one forward on rank ``r``), over the ``ep`` ranks of the group;
    rank ``r`` holds experts ``[r * E / ep, (r + 1) * E / ep)``.
    """
    ep, num_experts = len(counts_by_rank), len(counts_by_rank[0])
    if num_experts % ep or not 0 <= rank < ep:
        raise ValueError(f"exact_all_to_all_bytes: {num_experts} experts over {ep} ranks, rank {rank}: "
                         "the experts must divide evenly and the rank be one of them")
    local = num_experts // ep

    def to_rank(r: int, dest: int) -> int:
        return sum(counts_by_rank[r][dest * local:(dest + 1) * local])

    sent = sum(to_rank(rank, d) for d in range(ep) if d != rank)
    received = sum(to_rank(r, rank) for r in range(ep) if r != rank)
    forwards = 2 if recompute else 1
    rows = forwards * (sent + received) + sent + received
    return rows * dim * dtype_bytes + forwards * (num_experts - local) * COUNT_BYTES
