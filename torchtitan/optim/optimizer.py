"""Build the optimizer named in the training config."""

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

# Names are matched case-sensitively so that they read exactly like the
# torch.optim class names a user would write in the config file.
_OPTIMIZER_CLASSES: dict[str, type[torch.optim.Optimizer]] = {
    "Adam": torch.optim.Adam,
    "AdamW": torch.optim.AdamW,
}


def _implementation_kwargs(device_type: str) -> dict[str, bool]:
    """Pick the multi-tensor implementation for the device the params live on.

    On CUDA the fused kernel does the whole update in one launch per dtype
    group and DTensor has sharding rules for it, so FSDP2/TP params work.

    Elsewhere we use foreach. torch 2.13 (and 2.11) do ship a fused CPU
    Adam/AdamW, but foreach is the path every backend (CPU, MPS, XPU, ...)
    and every dtype supports, and on CPU the extra speed of fused does not
    matter for the small debug runs done there.
    """
    if device_type == "cuda":
        return {"fused": True}
    return {"foreach": True}


def build_optimizer(
    params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
    *,
    name: str,
    lr: float,
    eps: float,
    weight_decay: float,
    betas: tuple[float, float],
    device_type: str,
) -> torch.optim.Optimizer:
    """Create an Adam-family optimizer over ``params``.

    ``device_type`` is the type of the device holding the parameters
    ("cuda", "cpu", ...); it only selects the kernel implementation.
    """
    optimizer_cls = _OPTIMIZER_CLASSES.get(name)
    if optimizer_cls is None:
        choices = ", ".join(sorted(_OPTIMIZER_CLASSES))
        raise ValueError(f"optimizer.name must be one of [{choices}], got {name!r}")
    params = list(params)
    if all(isinstance(p, torch.Tensor) for p in params):
        dtensors = [p for p in params if isinstance(p, DTensor)]
        if dtensors and len(dtensors) < len(params):
            # TP without sequence parallelism or FSDP leaves the norm weights plain tensors
            # next to DTensor linears; the foreach kernels take one kind per call, and the
            # optimizer calls them once per group.
            params = [{"params": dtensors}, {"params": [p for p in params if not isinstance(p, DTensor)]}]
    return optimizer_cls(
        params,
        lr=lr,
        betas=tuple(betas),
        eps=eps,
        weight_decay=weight_decay,
        **_implementation_kwargs(device_type),
    )
