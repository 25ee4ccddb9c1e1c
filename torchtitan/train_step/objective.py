"""The step's objective: one list of loss terms, built once (``build_runner``), that the step back-propagates
and the trainer logs, each term its own way.

A term says how it is computed from the model's output, how its logged value is reduced across the
layout and under which name it is logged. Two kinds:

- ``TokenTerm``: a sum over the micro-batch's scored tokens, computed from the output (the main logits
  first, then multi-token prediction's depths) and the labels. The step adds them in list order, the
  cross-entropy first, and multiplies the total by the step's loss scale (``loss.py``): in the plain
  step and in the pipeline's last-stage loss alike.
- ``CarriedTerm``: a value the forward returns beside its output (the MoE auxiliary loss), split off
  the output and added after the scale, with its own weight.

What each term logs: ``take_step_sum`` gives a per-step sum that the step's tail sums over the data
ranks and divides by the step's tokens (read with the loss, logged under the term's name: ``z_loss``);
``metrics`` gives the window's values on logging steps (``mtp/loss``, ``moe/aux_loss``). The logged
``loss`` stays the cross-entropy alone.

A new term is a ``LossTerm`` subclass in its own module and one line in ``LOSS_TERMS``
(``train_step/build.py``), which lists how each is built from the job (``TermSources``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from torchtitan.compat import in_pipeline_shape_inference
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.collectives import local_value

if TYPE_CHECKING:
    from torchtitan.config import JobConfig
    from torchtitan.launch_plan import LaunchPlan

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Outputs = torch.Tensor | tuple[torch.Tensor, ...]  # a forward's output: the logits, or (logits, *depth logits)
Groups = Sequence[dist.ProcessGroup | None]  # the data ranks, then the pipeline stages


class LossTerm:
    """One item of the objective; the defaults: no extra model input, nothing logged."""

    name: str = ""  # what the log calls it

    def model_kwargs(self, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """What the training forward takes for this term besides the batch's own fields."""
        return {}

    def take_step_sum(self, device: torch.device) -> torch.Tensor | None:
        """This rank's sum of the last step (float64 on ``device``), once; None: the term logs no per-step value."""
        return None

    def metrics(self, groups: Groups) -> dict[str, float]:
        """The term's values since the last call, reduced over the layout; every rank calls it on logging steps."""
        return {}


class TokenTerm(LossTerm):
    """A sum over the scored tokens of a micro-batch, computed from its outputs and labels (see the module)."""

    def __call__(self, outputs: tuple[torch.Tensor, ...], labels: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class CarriedTerm(LossTerm):
    """A value the forward returns beside its output, weighed and added after the step's loss scale."""

    def start_step(self, forwards: int) -> None:
        """A step of ``forwards`` forwards (micro-batches x pipeline microbatches) begins."""

    def split(self, output: Outputs) -> tuple[Outputs, torch.Tensor | None]:
        """(the forward's output, the carried value or None)."""
        raise NotImplementedError

    def add_to(self, objective: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        """``objective`` plus the weighed carried value ``aux`` (the pipeline's ``OutputTerm`` protocol)."""
        raise NotImplementedError


class CrossEntropyTerm(TokenTerm):
    """The main loss of the logits (``loss.py``), the first term. Where other token terms share its backward, it
    keeps its own sums for the logged loss (``pop``)."""

    name = "loss"

    def __init__(self, loss_fn: LossFn):
        self.loss_fn = loss_fn
        self.keeps_sums = False  # set by ``Objective``
        self._sum: torch.Tensor | None = None

    def __call__(self, outputs: tuple[torch.Tensor, ...], labels: torch.Tensor) -> torch.Tensor:
        loss = self.loss_fn(outputs[0], labels)
        if self.keeps_sums and not in_pipeline_shape_inference():  # stand-in tensors learning shapes: not counted
            kept = local_value(loss).detach().double()
            self._sum = kept if self._sum is None else self._sum + kept
        return loss

    def pop(self, device: torch.device) -> torch.Tensor:
        """The loss sum since the last pop (zero on ``device`` when none: a stage without the output)."""
        kept, self._sum = self._sum, None
        return kept if kept is not None else torch.zeros((), dtype=torch.float64, device=device)


class Objective:
    """The list of terms as the step runs it: ``objective(output, labels)`` is the token terms' sum; ``carried``
    the one term the output may carry; ``logged_loss`` the cross-entropy alone."""

    def __init__(self, terms: Sequence[LossTerm]):
        self.terms = list(terms)
        self.token_terms = [term for term in self.terms if isinstance(term, TokenTerm)]
        carried = [term for term in self.terms if isinstance(term, CarriedTerm)]
        if not self.token_terms or not isinstance(self.token_terms[0], CrossEntropyTerm):
            raise ValueError("the objective's first token term must be the cross-entropy (CrossEntropyTerm)")
        if len(carried) > 1:
            raise ValueError(f"the forward carries one value beside its output; got {[t.name for t in carried]}")
        self.cross_entropy: CrossEntropyTerm = self.token_terms[0]
        self.cross_entropy.keeps_sums = len(self.token_terms) > 1
        self.carried: CarriedTerm | None = carried[0] if carried else None

    def __call__(self, output: Outputs, labels: torch.Tensor) -> torch.Tensor:
        outputs = output if isinstance(output, tuple) else (output,)
        total = self.token_terms[0](outputs, labels)
        for term in self.token_terms[1:]:  # added one by one, in order: a DTensor under loss parallel
            total = total + term(outputs, labels)
        return total

    @property
    def validation_loss(self) -> LossFn:
        """What validation scores: the cross-entropy alone."""
        return self.cross_entropy.loss_fn

    def model_kwargs(self, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every term's extra inputs of the training forward."""
        return {name: value for term in self.terms for name, value in term.model_kwargs(inputs).items()}

    def logged_loss(self, step_sum: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The loss sum the step logs: ``step_sum`` (what was back-propagated) when the cross-entropy is the only
        token term, else the cross-entropy's own sums."""
        return self.cross_entropy.pop(device) if self.cross_entropy.keeps_sums else step_sum

    def take_step_sums(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Each term's per-step sum on this rank, by name (terms without one left out)."""
        sums = {term.name: term.take_step_sum(device) for term in self.terms}
        return {name: value for name, value in sums.items() if value is not None}

    def metrics(self, groups: Groups) -> dict[str, float]:
        """Every term's logged values (collectives: every rank calls it on the same steps)."""
        return {name: value for term in self.terms for name, value in term.metrics(groups).items()}


@dataclass(frozen=True)
class TermSources:
    """What a term is built from: the job, its plan, the whole model (on meta), the layout and the step's
    cross-entropy (``loss_fn``)."""

    cfg: JobConfig
    plan: LaunchPlan
    model: torch.nn.Module
    dims: ParallelDims
    loss_fn: LossFn


TermBuilder = Callable[[TermSources], "LossTerm | None"]


def build_objective(sources: TermSources, builders: Sequence[TermBuilder]) -> Objective:
    """The cross-entropy, then each builder's term where the job has one, in the builders' order."""
    terms: list[LossTerm] = [CrossEntropyTerm(sources.loss_fn)]
    terms += [term for term in (build(sources) for build in builders) if term is not None]
    return Objective(terms)
