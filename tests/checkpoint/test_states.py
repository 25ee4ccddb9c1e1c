"""The registry of checkpoint states and the one-process side of the agreement helper (no process spawned)."""

from __future__ import annotations

import pickle
import random
from pathlib import Path

import pytest
import torch

from torchtitan.checkpoint.agreement import Agreement
from torchtitan.checkpoint.states import BUILTIN, FROM_STEP_0, STATE_KEYS, Holders, StateRegistry
from torchtitan.preflight import _unknown_states


class _Position:
    """A dataset's position: ``state_dict``/``load_state_dict`` like the trainer's loaders."""

    def __init__(self, window: int) -> None:
        self.window = window

    def state_dict(self) -> dict:
        return {"window": self.window}

    def load_state_dict(self, state: dict) -> None:
        self.window = state["window"]


class _Counter:
    def __init__(self, n: int) -> None:
        self.n = n

    def state_dict(self) -> dict:
        return {"n": torch.tensor(self.n)}

    def load_state_dict(self, state: dict) -> None:
        self.n = int(state["n"])


def _holders(seed: int) -> Holders:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    return Holders(model=model, optimizer=optimizer, lr_scheduler=scheduler, dataset=_Position(seed), rank=0)


def test_the_registry_names_each_state_once_in_saving_order():
    assert STATE_KEYS == ("model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng")
    # The preflight checks --checkpoint.exclude_from_loading against the registry's names, and offers them all.
    (problem,) = _unknown_states(["optimiser", *STATE_KEYS])
    assert "unknown state(s) optimiser;" in problem and problem.endswith(", ".join(STATE_KEYS))
    assert _unknown_states(list(STATE_KEYS)) == []
    registry = StateRegistry(_holders(0), {"semi_sync": _Counter(3)})
    # The manifest lists the built-in states alphabetically, then the extra ones, as before the registry.
    assert registry.names(model_only=False) == ["dataloader", "lr_scheduler", "model", "optimizer", "rng",
                                                "train_state", "semi_sync"]
    assert registry.names(model_only=True) == ["model"]
    assert list(registry.save_state(7, model_only=False)) == [*STATE_KEYS, "semi_sync"]
    assert list(registry.save_state(7, model_only=True)) == ["model"]
    assert registry.save_state(7, model_only=False)["train_state"] == {"step": 7}
    assert [spec.name for spec in BUILTIN if spec.same_layout_only] == ["rng"]


def test_only_a_loaded_train_state_resumes_a_step():
    registry = StateRegistry(_holders(0))
    assert [spec.name for spec in BUILTIN if spec.when_missing == FROM_STEP_0] == ["train_state"]
    assert registry.resumed_step(12, list(STATE_KEYS)) == 12
    assert registry.resumed_step(12, ["model"]) == 0  # a weights-only or seed checkpoint starts at step 0
    assert registry.resumed_step(12, [k for k in STATE_KEYS if k != "train_state"]) == 0


def test_an_extra_state_may_not_take_a_built_in_name():
    with pytest.raises(ValueError, match="'optimizer' has the name of a built-in state; rename it"):
        StateRegistry(_holders(0), {"optimizer": _Counter(1)})


def test_applying_a_saved_state_restores_every_holder():
    source, target = _holders(1), _holders(2)
    counter = _Counter(5)
    random.seed(11)
    saved = StateRegistry(source, {"semi_sync": counter}).save_state(3, model_only=False)
    expected_draw = random.random()
    # What a DCP load hands over: the saved values (the dataloader template needs DCP's metadata, unused here).
    fresh = _Counter(0)
    random.seed(99)
    StateRegistry(target, {"semi_sync": fresh}).apply(pickle.loads(pickle.dumps(saved)))
    assert random.random() == expected_draw
    for (name, a), (_, b) in zip(source.model.state_dict().items(), target.model.state_dict().items()):
        assert torch.equal(a, b), name
    assert target.lr_scheduler.state_dict()["last_epoch"] == source.lr_scheduler.state_dict()["last_epoch"] == 1
    assert target.dataset.window == 1 and fresh.n == 5
    state_a, state_b = source.optimizer.state_dict()["state"], target.optimizer.state_dict()["state"]
    assert all(torch.equal(state_a[i]["exp_avg"], state_b[i]["exp_avg"]) for i in state_a)


def test_one_process_agreement_raises_its_own_failure_and_passes_its_item(tmp_path: Path):
    agreement = Agreement(None, tmp_path)
    assert agreement.outcomes(None, "choosing the checkpoint", "step-4") == ["step-4"]
    with pytest.raises(RuntimeError, match=r"^checkpoint: loading x failed \(nothing was deleted\): boom$"):
        agreement.outcomes("boom", "loading x", None)
    agreement.same_checkpoint(["step-4"])
    with pytest.raises(RuntimeError, match="ranks see different checkpoints in .*: \\['step-4', None\\]"):
        agreement.same_checkpoint(["step-4", None])
