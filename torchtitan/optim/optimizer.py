"""Build the optimizer named in the training config."""

import logging
from collections.abc import Iterable, Sequence
from typing import Any, cast

import torch
from torch.distributed.tensor import DTensor

from torchtitan.compat import fused_kernel_devices
from torchtitan.optim.muon import MUON_OPTIMIZERS, Muon, MuonSettings
from torchtitan.optim.muon_owners import OwnerUpdate
from torchtitan.optim.muon_params import split_params

logger = logging.getLogger(__name__)

# Names are matched case-sensitively so that they read exactly like the
# torch.optim class names a user would write in the config file.
_OPTIMIZER_CLASSES: dict[str, type[torch.optim.Adam] | type[torch.optim.AdamW]] = {
    "Adam": torch.optim.Adam,
    "AdamW": torch.optim.AdamW,
}


# The dtypes torch's fused Adam/AdamW kernels take (on CPU and CUDA alike).
_FUSED_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def _no_fused_reason(device_type: str, tensors: list[torch.Tensor]) -> str | None:
    """Why the fused kernel cannot take ``tensors`` on ``device_type`` (None: it can)."""
    if device_type not in fused_kernel_devices():
        return f"torch {torch.__version__} has no fused kernel for {device_type}"
    others = sorted({str(t.dtype) for t in tensors if t.dtype not in _FUSED_DTYPES})
    return f"the fused kernel takes no {', '.join(others)}" if others else None


def _implementation_kwargs(device_type: str, tensors: list[torch.Tensor]) -> dict[str, bool]:
    """Fused where torch has a fused kernel for the device and every parameter's dtype, else foreach.

    The fused kernel does the whole update in one pass per dtype group, and DTensor has
    sharding rules for it, so FSDP2 and TP parameters take it too: the routed experts' stacked
    weights (3-D, sharded on the expert dim over the ``efsdp`` mesh while the rest sit on the dense
    mesh) go through the same call as the others, since DTensor runs a fused or foreach op over
    tensors of several meshes as one local kernel. On CPU it is several times faster than foreach
    on the debug model (benchmarks/README.md section 10). Foreach stays the path for any device or
    dtype the fused kernels do not cover.
    """
    return {"foreach": True} if _no_fused_reason(device_type, tensors) else {"fused": True}


def _expert_tensors(model_parts: list[torch.nn.Module] | None) -> set[int]:
    """The ids of the routed experts' stacked parameters (modules with ``stacked_names``: models/moe/experts.py)."""
    found: set[int] = set()
    for part in model_parts or ():
        for module in part.modules():
            names = getattr(module, "stacked_names", ())
            found.update(id(p) for name, p in module.named_parameters(recurse=False) if name in names)
    return found


def _log_kernel(name: str, device_type: str, groups: list[object], tensors: list[torch.Tensor],
                model_parts: list[torch.nn.Module] | None) -> None:
    """One line: which kernel the update takes, over how many tensors and calls, the experts' among them."""
    experts = _expert_tensors(model_parts)
    n_experts = sum(1 for t in tensors if id(t) in experts)
    reason = _no_fused_reason(device_type, tensors)
    logger.info("%s: the %s kernel over %d tensors in %d param group(s)%s%s", name,
                "fused" if reason is None else "foreach", len(tensors),
                sum(1 for g in groups if isinstance(g, dict)) or 1,
                f", the routed experts' {n_experts} stacked weights among them" if n_experts else "",
                f" (fused skipped: {reason})" if reason else "")


def build_optimizer(
    params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
    *,
    name: str,
    lr: float,
    eps: float,
    weight_decay: float,
    betas: Sequence[float],  # two: preflight checks it
    device_type: str,
    model_parts: list[torch.nn.Module] | None = None,
    muon: MuonSettings | None = None,
) -> torch.optim.Optimizer:
    """Create the optimizer named ``name`` over ``params``.

    ``device_type`` is the type of the device holding the parameters
    ("cuda", "cpu", ...); it only selects the kernel implementation.
    Muon needs ``model_parts`` (the modules the parameters belong to: which are matrices)
    and takes ``muon`` (its settings; the defaults where not given).
    """
    if name in MUON_OPTIMIZERS:  # MuonClip's clip is a post-step hook (train_step/max_logit.py)
        if model_parts is None:
            raise ValueError(f"optimizer.name={name}: build_optimizer needs model_parts to tell matrices apart")
        return build_muon(model_parts, lr=lr, eps=eps, weight_decay=weight_decay, betas=betas,
                          settings=muon or MuonSettings())
    optimizer_cls = _OPTIMIZER_CLASSES.get(name)
    if optimizer_cls is None:
        choices = ", ".join(sorted([*_OPTIMIZER_CLASSES, "Muon", "MuonClip"]))
        raise ValueError(f"optimizer.name must be one of [{choices}], got {name!r}")
    groups: list[Any] = list(params)  # tensors, or param-group dicts
    tensors = [t for p in groups for t in (p["params"] if isinstance(p, dict) else [p])]
    if all(isinstance(p, torch.Tensor) for p in groups):
        dtensors = [p for p in groups if isinstance(p, DTensor)]
        if dtensors and len(dtensors) < len(groups):
            # TP without sequence parallelism or FSDP leaves the norm weights plain tensors
            # next to DTensor linears; the foreach and fused kernels take one kind per call, and the
            # optimizer calls them once per group.
            groups = [{"params": dtensors}, {"params": [p for p in groups if not isinstance(p, DTensor)]}]
    _log_kernel(name, device_type, groups, tensors, model_parts)
    return optimizer_cls(
        groups,
        lr=lr,
        betas=cast(tuple[float, float], tuple(betas)),
        eps=eps,
        weight_decay=weight_decay,
        **_implementation_kwargs(device_type, tensors),
    )


def build_muon(model_parts: list[torch.nn.Module], *, lr: float, eps: float, weight_decay: float,
               betas: Sequence[float], settings: MuonSettings) -> Muon:
    """Muon over the matrices of ``model_parts``, AdamW over the rest; sharded matrices by owner ranks."""
    groups = split_params(model_parts, split_heads=settings.split_heads, adamw_fqns=settings.adamw_fqns)
    sharded = any(isinstance(p, DTensor) for p in groups.matrices)
    orthogonalize = OwnerUpdate(groups.matrices, groups.names, groups.row_parts) if sharded else None
    # One line, so a run's log says which optimizer took which tensors (the launcher matrix reads it).
    logger.info("Muon on %d matrices (%s), AdamW on %d other tensors", len(groups.matrices),
                "each orthogonalized by one owner rank" if sharded else "orthogonalized here", len(groups.others))
    return Muon(groups.matrices, groups.others, lr=lr, weight_decay=weight_decay,
                betas=cast(tuple[float, float], tuple(betas)), eps=eps, settings=settings,
                row_parts=groups.row_parts, orthogonalize=orthogonalize)
