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
from torchtitan.loss import count_tokens
from torchtitan.stability.z_loss import WithZLoss
from torchtitan.train_step.aux_loss import AuxLossTerm
from torchtitan.train_step.callbacks import StepCallbacks, StepPoint
from torchtitan.train_step.experts import ExpertBalance
from torchtitan.train_step.mtp import MTPLoss, mtp_settings

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class ModelRunner:
    """What a step runs: the model parts (one per pipeline stage held, else one), their optimizer and schedule."""

    def __init__(self, model_parts: list[torch.nn.Module], pp_runner: PipelineRunner | None,
                 optimizer: torch.optim.Optimizer, lr_scheduler: LRScheduler, loss_fn: LossFn, dims: ParallelDims,
                 device: torch.device, callbacks: StepCallbacks, flops_per_token: float,
                 experts: ExpertBalance | None = None, z_loss: WithZLoss | None = None,
                 aux_loss: AuxLossTerm | None = None):
        self.model_parts, self.pp_runner = model_parts, pp_runner
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        # ``loss_fn`` scores validation; training back-propagates ``z_loss`` (the loss plus z-loss) when it is on.
        self.loss_fn, self.dims, self.device, self.callbacks = loss_fn, dims, device, callbacks
        self.z_loss = z_loss
        self.train_loss_fn: LossFn = z_loss if z_loss is not None else loss_fn
        self._z_loss_sum: torch.Tensor | None = None
        self.flops_per_token = flops_per_token
        self.experts = experts  # a model with MoE layers: their balancing and metrics (train_step/experts.py)
        # their auxiliary loss, which the model returns with its output (train_step/aux_loss.py)
        self.aux_loss = aux_loss
        # multi-token prediction (train_step/mtp.py); preflight refuses it under pipeline parallelism
        depths, weight = mtp_settings(model_parts[0]) if pp_runner is None else (0, 0.0)
        self.mtp = MTPLoss(depths, weight) if depths else None

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for part in self.model_parts for p in part.parameters()]

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
        if self.aux_loss is not None:  # its weight: a mean over the step's forwards
            pipeline_microbatches = self.pp_runner.plan.microbatches if self.pp_runner is not None else 1
            self.aux_loss.start_step(len(batches) * pipeline_microbatches)
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
                mtp = {"labels": batch.labels} if self.mtp is not None else {}
                logits, aux = AuxLossTerm.split(model(batch.inputs, **batch.model_kwargs(), **mtp))
                emit(StepPoint.FORWARD_END, micro_batch=i)
                loss_sum = self.train_loss_fn(logits, batch.labels)
                del logits  # not kept through backward (autograd keeps what it needs)
                objective = loss_sum
                if self.mtp is not None:  # the extra depths' loss trains, the main loss is what is logged
                    objective = loss_sum + self.mtp.objective(model, batch.labels, self.loss_fn)
                emit(StepPoint.BACKWARD_START, micro_batch=i)
                # float32(scale) times the float32 loss sum, as a Python float scale would be applied.
                objective = objective * scale().to(objective.dtype)
                if aux is not None and self.aux_loss is not None:  # the MoE layers' auxiliary loss, weighed
                    objective = self.aux_loss.add_to(objective, aux)
                objective.backward()
            local_loss_sum += local_value(loss_sum).detach().double()
            del loss_sum
            emit(StepPoint.MICRO_BATCH_END, micro_batch=i)
        if self.z_loss is not None:
            local_loss_sum, self._z_loss_sum = self.z_loss.pop(self.device)  # the loss alone, logged apart
        return local_loss_sum

    def take_z_loss_sum(self) -> torch.Tensor | None:
        """This rank's z-loss sum of the last ``forward_backward`` (pipeline: summed over the stages), once;
        None when z-loss is off."""
        z, self._z_loss_sum = self._z_loss_sum, None
        return z

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
                local_loss_sum = local_loss_sum + self.pp_runner.step(batch, scale())
            self.callbacks.emit(StepPoint.MICRO_BATCH_END, micro_batch=i)
        pp_mesh = self.dims.get_mesh("pp")
        if self.z_loss is not None:
            # The last stage's loss function kept both parts (the other stages' are 0): the loss alone is logged.
            local_loss_sum, z_loss_sum = self.z_loss.pop(self.device)
            self._z_loss_sum = start_sum(z_loss_sum, pp_mesh)()
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
