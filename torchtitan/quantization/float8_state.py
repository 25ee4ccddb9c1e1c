"""What a checkpoint sees of Float8: plain tensors, and no precomputed scale that outlives a load.

With ``--float8.enable_fsdp_float8_all_gather`` torchao wraps each converted weight in its
cast-on-gather tensor (``WeightWithDynamicFloat8CastTensor``; under FSDP or TP, a DTensor's local
tensor). Saved as it is, DCP pickles that class into the checkpoint, which then loads only where
torchao is imported. The checkpoint's model state therefore holds the high-precision tensors the
wrappers hold (the same storage, no copy), so it does not depend on the precision either way.

``--float8.precompute_float8_dynamic_scale_for_fsdp`` stores each weight's scale on its wrapper
after every optimizer step. A load changes the weights without a step, and before it DCP's
optimizer template takes a zero-learning-rate step of the fresh model, whose hook computes scales
from the initial weights. So the scales are dropped after a load: the next all-gather computes each
from the loaded weights, bitwise what the precomputation gives (the same amax, the same float64
division), and the optimizer step's hook takes over from there. Dropping them needs no collective,
and every rank loads, so every rank drops them.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor


def _cast_tensor_class() -> type[WeightWithDynamicFloat8CastTensor] | None:
    """torchao's cast-on-gather weight class, or None when torchao's Float8 is not loaded (then no weight is one)."""
    module = sys.modules.get("torchao.float8.fsdp_utils")
    return None if module is None else module.WeightWithDynamicFloat8CastTensor


def plain_weights(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (a model state dict) with every cast-on-gather weight replaced by the tensor it wraps."""
    wrapper = _cast_tensor_class()
    if wrapper is None:
        return state
    return {fqn: _unwrapped(value, wrapper) for fqn, value in state.items()}


def _unwrapped(value: object, wrapper: type[WeightWithDynamicFloat8CastTensor]) -> object:
    if isinstance(value, DTensor) and isinstance(value._local_tensor, wrapper):
        inner = value._local_tensor._tensor
        return DTensor.from_local(inner, value.device_mesh, value.placements, run_check=False, shape=value.shape,
                                  stride=value.stride())
    if isinstance(value, wrapper):
        return value._tensor
    return value


def forget_precomputed_scales(model: nn.Module) -> None:
    """Drop the scales precomputed for ``model``'s cast-on-gather weights: the next all-gather computes them."""
    wrapper = _cast_tensor_class()
    if wrapper is None:
        return
    for param in model.parameters():
        # The local tensor itself: ``to_local()`` may return a view, a new wrapper whose scale nobody reads.
        local = param._local_tensor if isinstance(param, DTensor) else param
        if isinstance(local, wrapper):
            local._precomputed_scale = None
