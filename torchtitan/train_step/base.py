"""What every optimizer step is made of, whatever the strategy around it.

A step's tail, in this order: give gradients their parameters' placements -> clip by the
global norm (summed over the pipeline stages too) -> optimizer step -> LR step -> zero_grad ->
the global loss. Each strategy writes that order out in its ``run`` (a fault-tolerant step puts
its commit vote between clipping and the optimizer step); the pieces live here, so the pipeline
mesh and the clipping norm are the same in every strategy.

Nothing here reads a device value on the host: the loss and the grad norm are returned as
device tensors, and the trainer reads them only on the steps that need them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.distributed.device_mesh import DeviceMesh
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan.distributed.grads import clip_grad_norm_, match_grad_placements
from torchtitan.loss import LossScale

# A step's micro-batches: (inputs, labels), or (inputs, labels, positions) under document masking.
MicroBatches = list[tuple[torch.Tensor, ...]]


class StepModel(Protocol):
    """What a step uses of the model: forward and backward over a step's micro-batches (the trainer's)."""

    def prepare(self, batches: MicroBatches) -> MicroBatches:
        """The micro-batches on the device, cut to this rank's share of the sequence."""
        ...

    def forward_backward(self, batches: MicroBatches, scale: Callable[[], torch.Tensor],
                         before_micro_batch: Callable[[int], None] | None = None) -> torch.Tensor:
        """Accumulate ``loss sum * scale()`` gradients over the micro-batches; return this rank's loss sum (float64)."""
        ...


@dataclass
class StepParts:
    """What every strategy steps: the model, its optimizer and schedule, and the meshes its sums run over."""

    model: StepModel
    model_parts: list[torch.nn.Module]
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    loss_mesh: DeviceMesh | None  # the ranks that see different tokens (dp x cp)
    pp_mesh: DeviceMesh | None  # the pipeline stages, whose gradient norms add up
    max_norm: float
    dataloader: StatefulDataLoader


@dataclass
class StepOutput:
    """One optimizer step, as the trainer logs it. ``loss`` and ``grad_norm`` stay on the device."""

    step: int  # the step just taken: the trainer's, or a live peer's after a heal
    loss: torch.Tensor  # the global mean token loss (float64, 0-dim)
    grad_norm: torch.Tensor  # the global gradient norm before clipping (0-dim)
    lr: float  # the learning rate the optimizer step ran at


class StepStrategy:
    """One optimizer step over a step's micro-batches; subclasses write out ``run``."""

    def __init__(self, parts: StepParts):
        self.parts = parts

    # ---- the trainer's interface -----------------------------------------------
    def start(self, step: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Begin training after ``step`` (0, or a loaded checkpoint's): the batches from the loaded position on."""
        return iter(self.parts.dataloader)

    def run(self, batches: MicroBatches, step: int) -> StepOutput:
        """Take optimizer step number ``step`` over ``batches`` (the micro-batches)."""
        raise NotImplementedError

    def writes_checkpoint(self) -> bool:
        """Whether this process group writes the job's checkpoint now (fault tolerance: one group does)."""
        return True

    def checkpoint_states(self) -> dict[str, Any]:
        """States the strategy adds to full checkpoints: name -> object with ``state_dict``/``load_state_dict``."""
        return {}

    def close(self, wait: bool = True) -> None:
        """Stop what the strategy started (threads, servers); safe to call twice."""

    # ---- the pieces of a step's tail --------------------------------------------
    def local_scale(self, batches: MicroBatches) -> LossScale:
        """The loss scale over this group's ranks; summing its tokens starts now."""
        return LossScale(batches, self.parts.loss_mesh)

    def clip(self) -> torch.Tensor:
        """Fix the gradients' placements, then clip them by their global norm; return that norm."""
        params = [p for part in self.parts.model_parts for p in part.parameters()]
        match_grad_placements(params)
        return clip_grad_norm_(params, self.parts.max_norm, pp_mesh=self.parts.pp_mesh)

    def current_lr(self) -> float:
        """The learning rate the next optimizer step runs at."""
        return self.parts.optimizer.param_groups[0]["lr"]

    def zero_grad(self) -> None:
        self.parts.optimizer.zero_grad(set_to_none=True)
