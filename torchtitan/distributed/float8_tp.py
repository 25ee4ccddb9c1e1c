"""Tensor-parallel styles for Float8 linears: the FP8 all-gather of activations under tensorwise scaling.

A TP plan asks ``LinearStyles(region)`` for its styles instead of naming torch's. Where every linear
the style covers is a torchao ``Float8Linear`` with dynamic tensorwise scaling, the styles are
torchao's: the region's input is cast to FP8 once, before the sequence-parallel all-gather (half
the bytes of bf16), with one scale over the whole (sharded) tensor. Otherwise (plain linears,
rowwise recipes, whose per-row scales cannot cross the gather) torch's styles, which a
``Float8Linear`` takes like any linear. Gloo carries no float8 dtype ("Invalid scalar type"), so on
a CPU mesh the activations are gathered in high precision and only the products are FP8.
"""

from __future__ import annotations

import functools
import logging

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel


def float8_tensorwise(module: nn.Module) -> bool:
    """Whether ``module`` is a torchao Float8 linear casting with one dynamic scale per tensor."""
    if type(module).__name__ != "Float8Linear":  # no torchao import for a model without Float8
        return False
    from torchao.float8.config import ScalingGranularity, ScalingType
    from torchao.float8.float8_linear import Float8Linear

    assert isinstance(module, Float8Linear)
    config = module.config
    casts = (config.cast_config_input, config.cast_config_weight, config.cast_config_grad_output)
    return all(c.scaling_type is ScalingType.DYNAMIC and c.scaling_granularity is ScalingGranularity.TENSORWISE
               for c in casts)


logger = logging.getLogger(__name__)


@functools.cache
def _log_gloo_fallback() -> None:
    logger.info("Float8 under TP on a CPU mesh: activations are all-gathered in high precision (gloo carries no "
                "float8); the products stay FP8")


class LinearStyles:
    """The TP styles for the linears under ``region`` (a block, or the module a plan is applied to) on ``tp_mesh``."""

    def __init__(self, region: nn.Module, tp_mesh: DeviceMesh):
        self.region = region
        self.fp8_collectives = tp_mesh.device_type != "cpu"

    def _fp8(self, *fqns: str) -> bool:
        if not all(float8_tensorwise(self.region.get_submodule(fqn)) for fqn in fqns):
            return False
        if not self.fp8_collectives:
            _log_gloo_fallback()
        return self.fp8_collectives

    def colwise(self, fqn: str, *, output_layouts: Placement | None = None) -> ParallelStyle:
        if self._fp8(fqn):
            from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel

            return Float8ColwiseParallel(output_layouts=output_layouts)
        return ColwiseParallel(output_layouts=output_layouts)

    def rowwise(self, fqn: str, *, output_layouts: Placement | None = None) -> ParallelStyle:
        if self._fp8(fqn):
            from torchao.float8.float8_tensor_parallel import Float8RowwiseParallel

            return Float8RowwiseParallel(output_layouts=output_layouts)
        return RowwiseParallel(output_layouts=output_layouts)

    def prepare_input(self, fqn: str, consumers: tuple[str, ...], *, input_layouts: tuple[Placement, ...],
                      desired_input_layouts: tuple[Placement, ...]) -> ParallelStyle:
        """The input of submodule ``fqn``, read by its linears ``consumers`` (FQNs under ``fqn``)."""
        if consumers and self._fp8(*(f"{fqn}.{c}" for c in consumers)):
            from torchao.float8.float8_tensor_parallel import PrepareFloat8ModuleInput

            return PrepareFloat8ModuleInput(input_layouts=input_layouts, desired_input_layouts=desired_input_layouts,
                                            fwd_config_submodule_fqn=consumers[0])
        return PrepareModuleInput(input_layouts=input_layouts, desired_input_layouts=desired_input_layouts)
