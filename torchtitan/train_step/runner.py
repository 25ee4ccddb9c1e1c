"""The model runner: the model parts this rank holds, the pipeline schedule over them, the optimizer and
the LR schedule, and the forward and backward of a step's micro-batches (plain or through the pipeline).

``train_step/build.py`` builds it (``build_runner``), for the trainer and for the planner's dry run
alike; the step strategies (``train_step/base.py``) drive it: ``prepare`` puts a step's batches on the
device, ``forward_backward`` accumulates their gradients and returns the loss sum, and
``validation_forward`` scores a validation batch through the same forward. Nothing here reads a
device value on the host.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch.distributed.tensor.parallel import loss_parallel
from torch.optim.lr_scheduler import LRScheduler

from torchtitan.batch import Batch
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.collectives import local_value, start_sum
from torchtitan.distributed.context_parallel import shard_sequence
from torchtitan.distributed.pipeline_parallel import PipelineRunner
from torchtitan.distributed.stage_copies import StageCopies
from torchtitan.loss import count_tokens
from torchtitan.train_step.callbacks import StepCallbacks, StepPoint
from torchtitan.train_step.experts import ExpertBalance
from torchtitan.train_step.objective import LossFn, Objective


class ModelRunner:
    """What a step runs: the model parts (one per pipeline stage held, else one), their optimizer and schedule."""

    def __init__(self, model_parts: list[torch.nn.Module], pp_runner: PipelineRunner | None,
                 optimizer: torch.optim.Optimizer, lr_scheduler: LRScheduler, objective: Objective,
                 dims: ParallelDims, device: torch.device, callbacks: StepCallbacks, flops_per_token: float,
                 experts: ExpertBalance | None = None, stage_copies: StageCopies | None = None):
        self.model_parts, self.pp_runner = model_parts, pp_runner
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        # the list of loss terms (train_step/objective.py): what the step back-propagates (also the pipeline's
        # last stage's loss), validation's loss and what each term logs
        self.objective = objective
        self.dims, self.device, self.callbacks = dims, device, callbacks
        self._step_sums: dict[str, torch.Tensor] = {}  # the terms' per-step sums of the last forward_backward
        self.flops_per_token = flops_per_token
        self.experts = experts  # a model with MoE layers: their balancing and metrics (train_step/experts.py)
        # parameters the first and last pipeline stage both hold (distributed/stage_copies.py)
        self.stage_copies = stage_copies

    @property
    def loss_fn(self) -> LossFn:
        """What validation scores: the cross-entropy alone."""
        return self.objective.validation_loss

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for part in self.model_parts for p in part.parameters()]

    def uncounted_parameters(self) -> list[torch.nn.Parameter]:
        """Parameters the global gradient norm leaves out: this rank's second copies of another stage's."""
        return [] if self.stage_copies is None else self.stage_copies.uncounted()

    def extra_model_kwargs(self, batch: Batch) -> dict[str, torch.Tensor]:
        """What the training forward takes besides the batch's own fields (multi-token prediction's input ids)."""
        return self.objective.model_kwargs(batch.inputs)

    def train_context(self) -> contextlib.AbstractContextManager:
        """Context that forward *and* backward of a micro-batch run under."""
        return loss_parallel() if self.dims.loss_parallel_enabled else contextlib.nullcontext()

    def shard_batch(self, batch: Batch | Sequence[torch.Tensor]) -> Batch:
        """``batch`` (a ``Batch``, or a loader's tuple, named here) on the device; under CP this rank's
        load-balanced sequence chunks of every field (positions too: the model all-gathers them for its mask)."""
        batch = Batch.of(batch)
        if self.dims.cp_enabled:
            cp_rank, cp_size = self.dims.rank_and_size("cp")
            batch = batch.map(lambda t: shard_sequence(t, cp_rank, cp_size))
        return batch.map(lambda t: t.to(self.device))

    def prepare(self, batches: Sequence[Batch | Sequence[torch.Tensor]]) -> list[Batch]:
        """``shard_batch`` of every micro-batch of a step (the step strategy has named them already)."""
        return [self.shard_batch(batch) for batch in batches]

    def forward_backward(self, batches: list[Batch], scale: Callable[[], torch.Tensor],
                         before_micro_batch: Callable[[int], None] | None = None) -> torch.Tensor:
        """Accumulate ``loss sum * scale()`` gradients over the micro-batches; return this rank's loss sum (float64).

        Plain or through the pipeline schedule. The loss sum stays on the device (no host sync per
        micro-batch). ``scale()`` is first called after the first forward, so the token count is
        summed while that forward runs. ``before_micro_batch(i)`` runs before micro-batch ``i``
        (fault tolerance lets FSDP reduce on the last one only); not through the pipeline, whose
        schedule sets gradient sync itself.
        """
        carried = self.objective.carried  # the term the output carries (MoE auxiliary loss), if any
        if carried is not None:  # its weight: a mean over the step's forwards
            pipeline_microbatches = self.pp_runner.plan.microbatches if self.pp_runner is not None else 1
            carried.start_step(len(batches) * pipeline_microbatches)
        if self.pp_runner is not None:
            return self._pipeline_forward_backward(batches, scale)
        emit = self.callbacks.emit
        local_loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        model = self.model_parts[0]
        for i, batch in enumerate(batches):
            if before_micro_batch is not None:
                before_micro_batch(i)
            emit(StepPoint.MICRO_BATCH_START, micro_batch=i)
            with self.train_context():
                outputs = model(batch.inputs, **batch.model_kwargs(), **self.extra_model_kwargs(batch))
                aux = None
                if carried is not None:  # the MoE layers' summed auxiliary loss, returned beside the output
                    outputs, aux = carried.split(outputs)
                emit(StepPoint.FORWARD_END, micro_batch=i)
                loss_sum = self.objective(outputs, batch.labels)
                del outputs  # not kept through backward (autograd keeps what it needs)
                emit(StepPoint.BACKWARD_START, micro_batch=i)
                # float32(scale) times the float32 loss sum, as a Python float scale would be applied.
                objective = loss_sum * scale().to(loss_sum.dtype)
                if aux is not None and carried is not None:  # the MoE layers' auxiliary loss, weighed
                    objective = carried.add_to(objective, aux)
                objective.backward()
            local_loss_sum += local_value(loss_sum).detach().double()
            del loss_sum
            emit(StepPoint.MICRO_BATCH_END, micro_batch=i)
        return self._logged_loss(local_loss_sum)

    def _logged_loss(self, local_loss_sum: torch.Tensor) -> torch.Tensor:
        """The loss sum the step logs: the cross-entropy alone (the other terms logged apart); the terms'
        per-step sums kept for ``take_step_sums``."""
        self._step_sums = self.objective.take_step_sums(self.device)
        return self.objective.logged_loss(local_loss_sum, self.device)

    def take_step_sums(self) -> dict[str, torch.Tensor]:
        """This rank's per-step sums of the terms that log one (z-loss), by name, of the last ``forward_backward``
        (pipeline: summed over the stages); once."""
        sums, self._step_sums = self._step_sums, {}
        return sums

    def _pipeline_forward_backward(self, batches: list[Batch], scale: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``forward_backward`` through the pipeline schedule: each local batch is one schedule step.

        The loss sum lives on the last stage, so it is summed over ``pp`` (other stages add 0)
        and every rank logs the true loss.
        """
        assert self.pp_runner is not None, "called with a pipeline only"
        local_loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for i, batch in enumerate(batches):
            self.callbacks.emit(StepPoint.MICRO_BATCH_START, micro_batch=i)
            with self.train_context():  # around forward and backward: the schedule interleaves them
                local_loss_sum = local_loss_sum + self.pp_runner.step(batch, scale(), self.extra_model_kwargs(batch))
            self.callbacks.emit(StepPoint.MICRO_BATCH_END, micro_batch=i)
        if self.stage_copies is not None:  # after every micro-batch's backward: the copies' gradients summed
            self.stage_copies.sum_grads()
        pp_mesh = self.dims.get_mesh("pp")
        # The last stage's loss function kept the parts (the other stages' are 0): the main loss alone is logged.
        local_loss_sum = self._logged_loss(local_loss_sum)
        self._step_sums = {name: start_sum(value, pp_mesh)() for name, value in self._step_sums.items()}
        return start_sum(local_loss_sum, pp_mesh)()

    def validation_forward(self, batch: Batch | Sequence[torch.Tensor],
                           loss_fn: LossFn | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Loss sum of one validation batch through training's forward (None on a PP rank without the output),
        and the tokens this rank scored. ``loss_fn`` replaces training's loss (downstream evaluation sums
        each row apart); under CP each rank's value covers its share of the sequence."""
        batch, loss_fn = self.shard_batch(batch), loss_fn or self.loss_fn
        with self.train_context():
            if self.pp_runner is None:
                loss = loss_fn(self.model_parts[0](batch.inputs, **batch.model_kwargs()), batch.labels)
            else:
                loss = self.pp_runner.forward_only(batch, loss_fn)
        return (None if loss is None else local_value(loss)), count_tokens(batch.labels)
