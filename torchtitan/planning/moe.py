"""Mixture-of-experts layers in a dry run: the routing is assumed, since fake tensors hold no token counts.

A MoE layer reads its token counts on the host to size its all-to-all and, where it runs the exact
per-expert loop, its matmuls (``models/moe/dispatch.py``, ``experts.py``). Fake tensors have shapes and no
values, so the dry run swaps each layer's dispatcher for one that assumes the counts and runs everything
else as the real one does (the permutation, the count exchange, the row exchange on ``ep``, the regrouping,
the experts, the way back, the combine):

- **balanced** by default: each of the ``T x top_k`` (token, slot) pairs of a rank's ``T`` tokens goes to
  the experts evenly, ``T x top_k / E`` rows per expert, and each EP rank receives ``T x top_k / EP`` rows
  from every rank;
- with an **imbalance factor** ``f`` (max over mean tokens per expert, as the trainer logs it), the simulated
  rank stands for the slowest one: each of its experts gets ``f`` times the mean, so it receives ``f x T x
  top_k`` rows (at most all ``EP x T x top_k`` of its group), computes that many and sends them back. Its
  own tokens still go out evenly. Memory, expert FLOPs and the all-to-all bytes of that rank all follow.

Under EP 1 every expert is local and the factor changes no total (the grouped GEMM is priced by its FLOPs).
``grouped_mm_as_on`` (``compat.py``) makes the experts choose as a GPU does: ``torch._grouped_mm`` in
bf16, the per-expert loop otherwise.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from torchtitan import compat
from torchtitan.models.moe import MoE
from torchtitan.models.moe.dispatch import AllToAllDispatcher, LocalDispatcher, Routing
from torchtitan.preflight import LaunchPlan

# CUDA's grouped GEMM kernel (sm90) takes bf16 only; other dtypes run the loop on a GPU.
GPU_GROUPED_MM_DTYPES = frozenset({torch.bfloat16})


class ImbalanceError(ValueError):
    """An imbalance factor that cannot be a max over a mean."""


def check_imbalance(factor: float) -> None:
    if not factor >= 1.0:
        raise ImbalanceError(f"--moe_imbalance={factor}: the imbalance is max over mean tokens per expert, so it "
                             "is at least 1; use 1 (balanced routing, the default) or more")


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
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=self.group)  # the count exchange, as the real one
        sent, received = self._plan(sum(counts.tolist()))  # counts: this rank's, from sort (on the host)
        per_expert = [even_split(n, self.num_local_experts) for n in received]
        by_rank = _host([n for row in per_expert for n in row], (self.ep, self.num_local_experts))
        local = _host([sum(col) for col in zip(*per_expert, strict=True)], (self.num_local_experts,))
        return by_rank, local, received, sent


def assume_routing(model_parts: list[nn.Module], imbalance: float = 1.0) -> int:
    """Give every MoE layer of ``model_parts`` an assumed-routing dispatcher; the number of layers changed."""
    check_imbalance(imbalance)
    n = 0
    for part in model_parts:
        for m in part.modules():
            if isinstance(m, MoE):
                real = m.dispatcher
                m.dispatcher = (AssumedAllToAllDispatcher(real, imbalance) if isinstance(real, AllToAllDispatcher)
                                else AssumedLocalDispatcher(real.num_experts))
                n += 1
    return n


def moe_notes(plan: LaunchPlan, imbalance: float) -> list[str]:
    """The report's lines on what a dry run of a model with experts assumes (none for a dense model)."""
    args = plan.model_args
    experts = plan.model_spec.num_experts(args)
    if not experts:
        return []
    routing = ("balanced: each expert gets tokens x top_k / E rows" if imbalance == 1.0 else
               f"imbalance {imbalance:g} (max over mean tokens per expert): the simulated rank's experts get "
               f"{imbalance:g}x the mean rows, its all-to-all and expert work follow")
    return [f"MoE routing assumed {routing} (fake tensors hold no token counts; planning/moe.py); "
            f"{experts} experts, top_k {args.top_k}, EP {plan.dims.ep}; FLOPs/MFU count active parameters"]
