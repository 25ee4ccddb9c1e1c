"""Mixture-of-experts layers in a dry run: the routing is assumed, since fake tensors hold no token counts.

A MoE layer reads its token counts on the host to size its all-to-all and, where it runs the exact
per-expert loop, its matmuls. Fake tensors have shapes and no values, so the dry run has the family
(``Decoder.assume_routing``; ``models/moe/assumed.py`` for the MoE decoder) swap each layer's dispatcher
for one that assumes the counts and runs everything else as the real one does:

- **balanced** by default: each of the ``T x top_k`` (token, slot) pairs of a rank's ``T`` tokens goes to
  the experts evenly, ``T x top_k / E`` rows per expert, and each EP rank receives ``T x top_k / EP`` rows
  from every rank;
- with an **imbalance factor** ``f`` (max over mean tokens per expert, as the trainer logs it), the simulated
  rank stands for the slowest one: each of its experts gets ``f`` times the mean, so it receives ``f x T x
  top_k`` rows (at most all ``EP x T x top_k`` of its group), computes that many and sends them back. Its
  own tokens still go out evenly. Memory, expert FLOPs and the all-to-all bytes of that rank all follow.

Under EP 1 every expert is local and the factor changes no total (the grouped GEMM is priced by its FLOPs).
``grouped_mm_as_on`` (``compat/kernels.py``) makes the experts choose as a GPU does: ``torch._grouped_mm`` in
bf16, the per-expert loop otherwise.
"""

from __future__ import annotations

import torch
from torch import nn

from torchtitan.launch_plan import LaunchPlan
from torchtitan.models.spec import family_model

# CUDA's grouped GEMM kernel (sm90) takes bf16 only; other dtypes run the loop on a GPU.
GPU_GROUPED_MM_DTYPES = frozenset({torch.bfloat16})


class ImbalanceError(ValueError):
    """An imbalance factor that cannot be a max over a mean."""


def check_imbalance(factor: float) -> None:
    if not factor >= 1.0:
        raise ImbalanceError(f"--moe_imbalance={factor}: the imbalance is max over mean tokens per expert, so it "
                             "is at least 1; use 1 (balanced routing, the default) or more")


def assume_routing(model_parts: list[nn.Module], imbalance: float = 1.0) -> int:
    """Give every MoE layer of ``model_parts`` an assumed-routing dispatcher; the number of layers changed."""
    check_imbalance(imbalance)
    return sum(family_model(part, "assume_routing").assume_routing(imbalance) for part in model_parts)


def moe_notes(plan: LaunchPlan, imbalance: float) -> list[str]:
    """The report's lines on what a dry run of a model with experts assumes (none for a dense model)."""
    args = plan.model_args
    experts = args.num_experts
    if not experts:
        return []
    routing = ("balanced: each expert gets tokens x top_k / E rows" if imbalance == 1.0 else
               f"imbalance {imbalance:g} (max over mean tokens per expert): the simulated rank's experts get "
               f"{imbalance:g}x the mean rows, its all-to-all and expert work follow")
    return [f"MoE routing assumed {routing} (fake tensors hold no token counts; planning/moe.py); "
            f"{experts} experts, top_k {args.moe_args().top_k}, EP {plan.dims.ep}; FLOPs/MFU count active parameters"]
