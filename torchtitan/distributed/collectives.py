"""The scalar collectives of a step (token counts, loss sums), and the value of a replicated loss."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


def reduce_scalar(value: torch.Tensor | float, op: str, mesh: DeviceMesh | None) -> float:
    """Sum, max or mean a scalar over a 1-D mesh (identity when ``mesh`` is None)."""
    tensor = torch.as_tensor(value, dtype=torch.float64)
    if mesh is None or mesh.size() == 1:
        return float(tensor)
    device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" else "cpu"
    tensor = tensor.to(device)
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "mean": dist.ReduceOp.SUM}[op]
    dist.all_reduce(tensor, op=reduce_op, group=mesh.get_group())
    if op == "mean":
        tensor = tensor / mesh.size()
    return float(tensor)


def start_sum(value: torch.Tensor | float, mesh: DeviceMesh | None) -> Callable[[], torch.Tensor]:
    """Start summing a scalar over a 1-D mesh; the returned function waits and gives the sum (float64, 0-dim).

    The trainer starts the token-count and loss sums ahead of work that does not need them
    (the forward; clipping and the optimizer step), so that no rank stops at a blocking
    collective for one number (benchmarks/overhead.py measures this). The sum stays on the
    value's device: nothing is read on the host (the trainer reads on the steps that log).
    """
    tensor = torch.as_tensor(value, dtype=torch.float64)
    if mesh is None or mesh.size() == 1:
        return lambda: tensor
    tensor = tensor.detach().clone()  # summed in place: never into the caller's tensor
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=mesh.get_group(), async_op=True)
    assert work is not None, "async_op=True returns the Work"

    def finish() -> torch.Tensor:
        work.wait()
        return tensor

    return finish


def local_value(loss: torch.Tensor) -> torch.Tensor:
    """The plain tensor of a loss; under loss parallel it is a replicated DTensor and every TP rank holds the full
    value."""
    return loss.to_local() if isinstance(loss, DTensor) else loss


class _SumGrad(torch.autograd.Function):
    """Identity forward; the backward all-reduces (sums) the gradient over ``group``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # noqa: ANN001
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        grad = grad.clone(memory_format=torch.contiguous_format)  # autograd's may be shared: reduce a copy
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_grad_over(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``x``, whose gradient is summed over ``group`` in the backward (None: ``x`` unchanged). For a value each
    rank of ``group`` uses on its own share of the work (a weight replicated over TP ranks that route their
    own tokens; MLA's rotary key, which every TP rank's heads read)."""
    return x if group is None else _SumGrad.apply(x, group)
