"""The MoE auxiliary loss in the step's loss: its weight, its micro-batch scaling, and what is logged of it.

A training forward of a model with an auxiliary balance loss returns ``(output, aux)``
(``models/aux_loss.py``): ``aux`` is the sum over the model's MoE layers of their losses, without their
coefficient. The step's loss splits it off (``split``), scores the output as usual and adds
``coeff / forwards / tp_split * aux`` (``add_to``), ``forwards`` being the step's forwards (micro-batches
x pipeline microbatches): the mean over them, as the main loss is a mean over the step's tokens, and,
through the data-parallel gradient average, over the data ranks. ``tp_split`` is the TP degree where
expert parallelism borrows TP's ranks (each TP rank then routes, and scores, its own sequence shard, and
the router's gradient is summed over TP: 1 / tp makes that sum their mean), else 1. The plain step adds it to its scaled
loss; through the pipeline, the last stage's loss (``ScaledLoss``) does. Either way the gradient each
layer's loss receives is ``float32(coeff / forwards)``, and the logged loss stays the main one.

It is a term of the step's objective (``train_step/objective.py``): the value the forward carries.
What is logged: ``moe/aux_loss``, the mean over the layers and the forwards since the last log
(``metrics``: kept on the ranks whose loss saw the sums, the pipeline's last stage, then averaged over
every rank that kept some).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtitan.compat import in_pipeline_shape_inference
from torchtitan.distributed.collectives import local_value
from torchtitan.models.aux_loss import split_aux_loss
from torchtitan.models.spec import family_model
from torchtitan.train_step.objective import CarriedTerm, Groups, Outputs, TermSources


class AuxLossTerm(CarriedTerm):
    """``coeff / forwards`` times the model's summed auxiliary loss, in the step's loss; see the module docstring.

    ``num_layers``: the MoE layers of the whole model (every pipeline stage's), for the logged mean;
    ``tp_split``: the TP ranks that route their own tokens (see the module docstring).
    """

    name = "moe/aux_loss"

    def __init__(self, coeff: float, num_layers: int, tp_split: int = 1):
        self.coeff, self.num_layers, self.tp_split = coeff, num_layers, tp_split
        self.weight = coeff / tp_split
        self._sum: torch.Tensor | None = None  # float64 on the device: the sums of the forwards since ``pop``
        self._forwards = 0

    def start_step(self, forwards: int) -> None:
        """The step's weight: ``coeff * (1 / forwards) / tp_split`` (a mean over the step's forwards)."""
        self.weight = self.coeff * (1.0 / forwards) / self.tp_split

    @staticmethod
    def of(sources: TermSources) -> AuxLossTerm | None:
        """The term when the (whole, meta) model's MoE layers have an auxiliary loss, else None; split over TP
        where expert parallelism borrows TP's ranks (``parallelize`` splits the layers so)."""
        layers = family_model(sources.model, "AuxLossTerm").expert_layers()
        coeff = max((layer.aux_loss_coeff for layer in layers), default=0.0)
        dims = sources.dims
        tp_split = dims.tp if dims.tp_enabled and dims.ep_borrows_tp else 1
        return AuxLossTerm(coeff, len(layers), tp_split) if coeff > 0 else None

    def split(self, output: Outputs) -> tuple[Outputs, torch.Tensor | None]:
        """(the forward's output, its summed auxiliary loss or None)."""
        return split_aux_loss(output)

    def add_to(self, objective: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        """``objective + weight * aux``, in ``objective``'s dtype (and as a replicated DTensor under loss
        parallel); keeps the detached sum for the log, except on a pipeline's shape-learning forward."""
        if not in_pipeline_shape_inference():
            value = aux.detach().double().sum()
            self._sum = value if self._sum is None else self._sum + value
            self._forwards += 1
        term = (aux.sum() * self.weight).to(objective.dtype)
        if isinstance(objective, DTensor):
            term = DTensor.from_local(term, objective.device_mesh, objective.placements, run_check=False)
        return objective + term

    def pop(self, device: torch.device) -> tuple[torch.Tensor, int]:
        """(the sum over forwards of the per-forward mean over the model's layers, the layers seen) since the
        last call, on ``device`` (zeros when none), and start again. ``sum / layers`` is the logged mean."""
        total, forwards = self._sum, self._forwards
        self._sum, self._forwards = None, 0
        if total is None or forwards == 0:
            return torch.zeros((), dtype=torch.float64, device=device), 0
        return local_value(total).to(device) / forwards, self.num_layers

    def metrics(self, groups: Groups) -> dict[str, float]:
        """``moe/aux_loss`` since the last call: the sums of every rank (the whole world: expert parallelism
        borrowing TP's ranks gives each its own) over their layers; a collective on logging steps."""
        total, layers = self.pop(torch.device("cpu"))
        sums = torch.tensor([float(total), layers], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else sums.device
            reduced = sums.to(device)
            dist.all_reduce(reduced)
            sums = reduced.cpu()
        return {self.name: float(sums[0] / sums[1])} if sums[1] > 0 else {}
