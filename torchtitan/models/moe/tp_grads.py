"""Gradients summed over the tensor-parallel ranks, for the MoE weights that each TP rank uses on other tokens.

When expert parallelism borrows TP's ranks (``ParallelDims.ep_borrows_tp``), each TP rank routes its own
sequence shard through a MoE layer. The router and the shared experts are replicated over TP, as a
sequence-parallel norm is, and each rank's gradient of them is then the sum over its own tokens only:
the whole gradient is the sum over the TP ranks. ``sum_grad_over`` (distributed/collectives.py) is the weight in the
forward and all-reduces its gradient over ``group`` in the backward, where the weight is used: it works the
same under FSDP (which reduces the summed gradient over the data ranks afterwards), activation
checkpointing and pipeline stages, and needs no DTensor on the MoE's local tensors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

from torchtitan.distributed.collectives import sum_grad_over


def call_summing_grads(module: nn.Module, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``module(x)`` with every parameter's gradient summed over ``group`` (None: a plain call).

    ``functional_call`` keeps the module's own forward (a Float8 linear stays one) and its parameters' names.
    """
    if group is None:
        return module(x)
    params = {name: sum_grad_over(p, group) for name, p in module.named_parameters()}
    return functional_call(module, params, (x,))
