"""What every optimizer step is made of, whatever the strategy around it, and the step's tail, written once.

A step: batches to the device -> forward/backward over the micro-batches (``ModelRunner``) -> the
tail, in this order: give gradients their parameters' placements -> clip by the global norm
(summed over the pipeline stages too) -> [``commit``: fault tolerance's vote] -> [the bad-step guard:
skip this step? (stability/guard.py)] -> [``before_optimizer_step``: semi-sync's bookkeeping] ->
``balance_experts`` (a model with MoE layers: the routing biases move from the step's token counts) ->
optimizer step -> [``after_optimizer_step``: did semi-sync's sync commit?] -> LR step -> zero_grad ->
[``after_step``: the replica check] -> the global loss. A strategy writes
only what comes before the tail (how the loss is scaled and summed, what happens around the
forward) and overrides the hooks; the order above is ``finish``'s alone.

The step's callbacks (``train_step/callbacks.py``) are called at its named points.

The strategy reads its own micro-batches (``begin``, then ``next_step``): a batch goes from the data
loader to the device without passing through the trainer, which gets the step's token count back.

Nothing here reads a device value on the host: the loss and the grad norm are returned as
device tensors, and the trainer reads them only on the steps that need them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.optim.lr_scheduler import LRScheduler
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan.batch import Batch
from torchtitan.distributed.collectives import start_sum
from torchtitan.distributed.grads import clip_grad_norm_, match_grad_placements
from torchtitan.loss import LossScale
from torchtitan.stability.guard import BadStepGuard
from torchtitan.train_step.callbacks import StepCallbacks, StepPoint
from torchtitan.train_step.runner import ModelRunner


class TokenCount(Protocol):
    """What the tail divides the loss sum by: a loss scale's global token count (``LossScale`` and its kin)."""

    @property
    def global_tokens(self) -> torch.Tensor: ...


@dataclass
class StepParts:
    """What every strategy steps: the model runner, the meshes its sums run over, the clipping norm, the data."""

    runner: ModelRunner
    loss_mesh: DeviceMesh | None  # the ranks that see different tokens (dp x cp)
    pp_mesh: DeviceMesh | None  # the pipeline stages, whose gradient norms add up
    max_norm: float
    dataloader: StatefulDataLoader | None  # None in the planner's dry run, which makes its own batches
    guard: BadStepGuard | None = None  # [stability]: skips bad steps before the optimizer step

    @property
    def model_parts(self) -> list[torch.nn.Module]:
        return self.runner.model_parts

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.runner.optimizer

    @property
    def lr_scheduler(self) -> LRScheduler:
        return self.runner.lr_scheduler

    @property
    def callbacks(self) -> StepCallbacks:
        return self.runner.callbacks


@dataclass
class StepOutput:
    """One optimizer step, as the trainer logs it. ``loss`` and ``grad_norm`` stay on the device."""

    step: int  # the step just taken: the trainer's, or a live peer's after a heal
    loss: torch.Tensor  # the global mean token loss (float64, 0-dim)
    grad_norm: torch.Tensor  # the global gradient norm before clipping (0-dim)
    lr: float  # the learning rate the optimizer step ran at
    tokens: int = 0  # input positions of this rank's micro-batches (before any context-parallel split)
    skipped: torch.Tensor | None = None  # [stability]: whether the guard skipped the step (0-dim bool)
    # the loss terms' means per token that are logged each step, by name (``z_loss`` when z-loss is on; float64)
    terms: dict[str, torch.Tensor] = field(default_factory=dict)


class StepStrategy:
    """One optimizer step over a step's micro-batches; subclasses write ``_run`` up to the tail."""

    def __init__(self, parts: StepParts):
        self.parts = parts
        self._data: Iterator[Batch | tuple[torch.Tensor, ...]] | None = None
        self._micro_batches = 1

    # ---- the trainer's interface -----------------------------------------------
    def start(self, step: int) -> Iterator[Batch | tuple[torch.Tensor, ...]]:
        """Begin training after ``step`` (0, or a loaded checkpoint's): the batches from the loaded position on."""
        assert self.parts.dataloader is not None, "only the planner's dry run has none, and it feeds its own batches"
        return iter(self.parts.dataloader)

    def begin(self, step: int, micro_batches: int, data: Iterator | None = None) -> None:
        """Begin training after ``step``: from now on ``next_step`` reads ``micro_batches`` batches a step, from
        ``data`` (a rollback's, already past the skipped window) or the loader's position (``start``)."""
        self._data, self._micro_batches = self.start(step) if data is None else data, micro_batches

    def next_step(self, step: int, loaded: Callable[[], None] | None = None) -> StepOutput:
        """Take optimizer step number ``step`` over the next micro-batches of the data (``begin`` first);
        ``loaded()`` is called once they are read (the trainer times the data loading)."""
        assert self._data is not None, "begin() first"
        batches = [next(self._data) for _ in range(self._micro_batches)]
        if loaded is not None:
            loaded()
        return self.run(batches, step)

    def run(self, batches: Sequence[Batch | Sequence[torch.Tensor]], step: int) -> StepOutput:
        """Take optimizer step number ``step`` over ``batches`` (the micro-batches: ``Batch``es, or a loader's
        tuples, named here)."""
        callbacks = self.parts.callbacks
        callbacks.begin(self, step)
        named = [Batch.of(batch) for batch in batches]
        out = self._run(self.parts.runner.prepare(named), step)
        out.tokens = sum(batch.inputs.numel() for batch in named)
        callbacks.emit(StepPoint.STEP_END, output=out)
        return out

    def _run(self, batches: list[Batch], step: int) -> StepOutput:
        """The step over ``batches``, already on the device; ends in ``finish``."""
        raise NotImplementedError

    def writes_checkpoint(self) -> bool:
        """Whether this process group writes the job's checkpoint now (fault tolerance: one group does)."""
        return True

    def checkpoint_states(self) -> dict[str, Any]:
        """States the strategy adds to full checkpoints: name -> object with ``state_dict``/``load_state_dict``."""
        return {}

    def close(self, wait: bool = True) -> None:
        """Stop what the strategy started (threads, servers); safe to call twice."""

    # ---- the step -----------------------------------------------------------------
    def local_scale(self, batches: list[Batch]) -> LossScale:
        """The loss scale over this group's ranks; summing its tokens starts now."""
        return LossScale(batches, self.parts.loss_mesh)

    def forward_backward(self, batches: list[Batch], scale: Callable[[], torch.Tensor],
                         before_micro_batch: Callable[[int], None] | None = None) -> torch.Tensor:
        """The runner's forward/backward over the micro-batches (this rank's loss sum); then ``GRADIENTS_READY``."""
        local_loss_sum = self.parts.runner.forward_backward(batches, scale, before_micro_batch)
        self.parts.callbacks.emit(StepPoint.GRADIENTS_READY)
        return local_loss_sum

    def finish(self, step: int, loss_sum: Callable[[], torch.Tensor], scale: TokenCount) -> StepOutput | None:
        """The tail of every step: clip -> commit? -> guard? -> optimizer step -> LR step -> zero_grad -> the loss.

        ``loss_sum()`` gives the step's global loss sum, waited for only after the optimizer step (before it
        when the bad-step guard judges the loss). None when ``commit`` voted the step away (its gradients
        are dropped).
        """
        parts = self.parts
        # the loss terms' per-step sums (z-loss), summed over the data ranks meanwhile
        term_totals = {name: self.global_sum(local) for name, local in parts.runner.take_step_sums().items()}
        grad_norm = self.clip()
        if not self.commit():
            self.zero_grad()
            return None
        lr = self.current_lr()  # after the vote: a step that healed runs at its peer's learning rate
        skipped = None
        if parts.guard is not None:
            skipped = parts.guard.decide(parts.optimizer, loss_sum() / scale.global_tokens, grad_norm)
        parts.callbacks.emit(StepPoint.OPTIMIZER_STEP)
        self.before_optimizer_step()
        self.balance_experts()
        parts.optimizer.step()
        self.after_optimizer_step()
        parts.lr_scheduler.step()
        self.zero_grad()
        self.after_step()
        tokens = scale.global_tokens
        return StepOutput(step=self.step_taken(step), loss=loss_sum() / tokens, grad_norm=grad_norm, lr=lr,
                          skipped=skipped, terms={name: total() / tokens for name, total in term_totals.items()})

    def global_sum(self, local: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Start summing a rank's share of a step total over the ranks that see different tokens (and, under
        fault tolerance, the live groups); the returned function waits for the sum."""
        return start_sum(local, self.parts.loss_mesh)

    # ---- the tail's hooks (fault tolerance, semi-sync) ------------------------------
    def commit(self) -> bool:
        """Whether to apply the step (fault tolerance: the groups' vote, in which a healing group heals)."""
        return True

    def before_optimizer_step(self) -> None:
        """Just before the optimizer step (semi-sync notes its sync count)."""

    def after_optimizer_step(self) -> None:
        """Just after the optimizer step (semi-sync: did the step's sync commit?)."""

    def after_step(self) -> None:
        """After the LR step and zero_grad (fault tolerance: the replica check)."""

    def step_taken(self, step: int) -> int:
        """The number of the step just taken (fault tolerance: a live peer's, after a heal)."""
        return step

    # ---- the pieces of the tail ------------------------------------------------------
    def clip(self) -> torch.Tensor:
        """Fix the gradients' placements, then clip them by their global norm; return that norm."""
        params = self.parts.runner.parameters()
        match_grad_placements(params)
        return clip_grad_norm_(params, self.parts.max_norm, pp_mesh=self.parts.pp_mesh,
                               uncounted=self.parts.runner.uncounted_parameters())

    def balance_experts(self) -> None:
        """The routing biases move from the step's token counts (a model with MoE layers; else nothing)."""
        experts = self.parts.runner.experts
        if experts is not None:
            experts.update()

    def current_lr(self) -> float:
        """The learning rate the next optimizer step runs at."""
        return self.parts.optimizer.param_groups[0]["lr"]

    def zero_grad(self) -> None:
        self.parts.optimizer.zero_grad(set_to_none=True)
