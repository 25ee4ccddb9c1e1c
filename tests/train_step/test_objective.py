"""The step's objective as a list of loss terms: their sum in order, the logged loss, each term's own log, and
a new term registered in one line."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from torchtitan.loss import IGNORE_INDEX, cross_entropy_sum
from torchtitan.stability.z_loss import ZLossTerm, z_loss_sum
from torchtitan.train_step import build as build_module
from torchtitan.train_step import max_logit
from torchtitan.train_step.aux_loss import AuxLossTerm
from torchtitan.train_step.mtp import MTPTerm
from torchtitan.train_step.objective import (
    CrossEntropyTerm,
    Groups,
    Objective,
    TermSources,
    TokenTerm,
    build_objective,
)

CPU = torch.device("cpu")


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=generator) * 4
    labels = torch.randint(0, 11, (2, 5), generator=generator)
    labels[1, 3:] = IGNORE_INDEX
    return logits, labels


class MaxLogitTerm(TokenTerm):
    """A stand-in for a new term (a logit statistic): its weighted sum is trained, its window mean logged."""

    name = "max_logit"

    def __init__(self, weight: float):
        self.weight, self._seen = weight, torch.zeros((), dtype=torch.float64)

    def __call__(self, outputs: tuple[torch.Tensor, ...], labels: torch.Tensor) -> torch.Tensor:
        value = outputs[0].amax(dim=-1).sum()
        self._seen = self._seen + value.detach().double()
        return value * self.weight

    def metrics(self, groups: Groups) -> dict[str, float]:
        return {self.name: float(self._seen)}


def test_token_terms_add_in_order_and_the_logged_loss_is_the_cross_entropy_alone():
    logits, labels = _batch()
    objective = Objective([CrossEntropyTerm(cross_entropy_sum), ZLossTerm(1e-3), MaxLogitTerm(0.5)])
    total = objective(logits, labels)
    ce = cross_entropy_sum(logits, labels)
    # the step's operations, in the list's order: the bits of the sum depend on it
    assert torch.equal(total, (ce + z_loss_sum(logits, labels, 1e-3)) + logits.amax(dim=-1).sum() * 0.5)
    assert torch.equal(objective.logged_loss(total.double(), CPU), ce.double())
    assert objective.take_step_sums(CPU) == {"z_loss": z_loss_sum(logits, labels, 1e-3).double()}
    assert objective.metrics([None]) == {"max_logit": float(logits.amax(dim=-1).sum().double())}
    alone = Objective([CrossEntropyTerm(cross_entropy_sum)])  # nothing kept apart: the step's own sum is logged
    assert torch.equal(alone(logits, labels), ce) and alone.logged_loss(ce.double(), CPU) is not None
    assert alone.take_step_sums(CPU) == {} and alone.carried is None


class ConstantTerm(TokenTerm):
    def __init__(self, value: float):
        self.value = value

    def __call__(self, outputs: tuple[torch.Tensor, ...], labels: torch.Tensor) -> torch.Tensor:
        return torch.tensor(self.value)


def test_the_terms_are_added_from_the_cross_entropy_on_one_by_one():
    """float32: (1 + 2^-24) + 2^-24 rounds to 1 twice, while 1 + (2^-24 + 2^-24) is 1 + 2^-23; the step's bits
    depend on the order, which is the list's (the cross-entropy first)."""
    logits, labels = _batch()
    one = CrossEntropyTerm(lambda logits, labels: torch.tensor(1.0))
    total = Objective([one, ConstantTerm(2.0 ** -24), ConstantTerm(2.0 ** -24)])(logits, labels)
    assert total.item() == 1.0


def test_a_list_the_step_cannot_run_is_refused():
    with pytest.raises(ValueError, match="first token term must be the cross-entropy"):
        Objective([ZLossTerm(1e-4), CrossEntropyTerm(cross_entropy_sum)])
    with pytest.raises(ValueError, match="carries one value"):
        Objective([CrossEntropyTerm(cross_entropy_sum), AuxLossTerm(0.01, 2), AuxLossTerm(0.01, 2)])


def test_build_objective_adds_the_registered_terms_the_job_turns_on_in_order():
    from torchtitan.config import ConfigManager

    cfg = ConfigManager().parse_args(["--stability.z_loss_multiplier=1e-3"])
    # z-loss reads the job alone: no plan, model or layout needed here
    sources = TermSources(cfg, plan=None, model=torch.nn.Linear(1, 1), dims=None, loss_fn=cross_entropy_sum)
    objective = build_objective(sources, (ZLossTerm.of, lambda _: None, lambda _: MaxLogitTerm(0.5)))
    assert [term.name for term in objective.terms] == ["loss", "z_loss", "max_logit"]
    # the step's order, as before; QK-clip's log (MuonClip) last: it adds nothing to the loss
    assert build_module.LOSS_TERMS == (ZLossTerm.of, MTPTerm.of, AuxLossTerm.of, max_logit.MaxLogitTerm.of)
    off = ConfigManager().parse_args([])
    assert build_objective(dataclasses.replace(sources, cfg=off), (ZLossTerm.of,)).terms[1:] == []
