"""The states a checkpoint holds: one entry per state, naming it and saying how it is saved and loaded.

Each ``StateSpec`` is the one place that knows a state's name (its top-level key in the DCP
state dict and in the manifest's ``states``), what is written, what DCP fills on a load, how
the loaded value is set, whether weights-only and seed checkpoints hold it, and what a run
does when a checkpoint lacks it. ``BUILTIN`` lists those of every run, in the order they are
saved, read and set; a run's extra states (``semi_sync``: DiLoCo's reference parameters,
outer momentum and counters) join them through ``extra_state``.

- ``model``: every parameter under its original FQN, as this layout holds it (DTensor
  shards under FSDP/HSDP/DDP/TP, plain tensors on one process). DCP records global
  shapes, so any other layout can load it: that is the resharding resume.
- ``optimizer``: ``get_optimizer_state_dict``'s flattened form (one key per parameter
  and state), sharded like the model.
- ``lr_scheduler``: the scheduler's state as JSON text (a few numbers; identical on all ranks).
- ``dataloader``: the *global* position of the sample stream (epoch, next window),
  which is the same on every rank and independent of the DP degree; see
  ``torchtitan/datasets/loaders.py``. A run with another DP degree continues the
  same global stream from there.
- ``train_state``: the step.
- ``rng``: each rank's Python/NumPy/torch generator states, as JSON text under ``rank<r>``. They are
  restored only when the layout is unchanged; with another layout ranks do not
  correspond, and every rank keeps the seed that ``training.seed`` gave it.

Nothing here is pickled: a checkpoint read from a shared bucket must not run code
(``no_pickle.py``); a checkpoint that still holds the old pickled blobs is refused in one line.

Nothing here communicates or touches the checkpoint folder: the saver and the loader do.
"""

from __future__ import annotations

import base64
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.checkpoint.no_pickle import from_json, to_json
from torchtitan.quantization.float8_state import forget_precomputed_scales, plain_weights

# Optimizer state keyed per parameter ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr"). The
# nested form keeps each param group as one list of FQNs, which differs between pipeline
# ranks under one key; DCP would keep only one rank's list and the others could not load.
OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

# What a run does with a state this run has but the checkpoint it loads lacks (a weights-only
# or seed checkpoint lacks all but the model; an older run may lack an extra state).
FRESH = "starts fresh"  # the state keeps what this run built (its initial value)
FROM_STEP_0 = "step 0"  # the run continues after step 0: only a loaded train state resumes a step


@dataclass
class Holders:
    """What the states are read from and written into: this rank's model view, optimizer, ... ."""

    model: torch.nn.Module  # every pipeline stage of this rank as one module (``stage_view.model_view``)
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler
    dataset: Stateful  # the position lives in the dataset: ``state_dict`` / ``load_state_dict``
    rank: int


@dataclass(frozen=True)
class StateSpec:
    """One state of a checkpoint.

    ``save(holders, step)``: the value written. ``template(holders, saved_metadata)``: what DCP
    fills on a load, shaped like this layout's state (``saved_metadata()`` returns the
    checkpoint's DCP metadata, for a state shaped like the checkpoint). ``apply(holders, value)``:
    set the loaded value. ``model_only``: weights-only and seed checkpoints hold it too.
    ``same_layout_only``: restored only when the checkpoint's layout is this run's.
    ``when_missing``: what this run does when the checkpoint lacks the state (``FRESH``, ``FROM_STEP_0``).
    """

    name: str
    save: Callable[[Holders, int], object]
    template: Callable[[Holders, Callable[[], Metadata]], object]
    apply: Callable[[Holders, Any], object]  # what it returns is ignored
    model_only: bool = False
    same_layout_only: bool = False
    when_missing: str = FRESH


def _tensor_text(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _text_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def _rng_state() -> str:
    """This rank's generator states as JSON (torch's byte states in base64)."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"python": [version, list(internal), gauss], "torch": _tensor_text(torch.get_rng_state())}
    try:
        import numpy as np

        legacy = np.random.get_state(legacy=True)
        assert isinstance(legacy, tuple), "numpy's legacy generator state is a tuple"  # a dict only without legacy
        name, keys, pos, has_gauss, cached = legacy
        state["numpy"] = [name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = _tensor_text(torch.cuda.get_rng_state())
    return to_json(state)


def _set_rng_state(text: object) -> None:
    state = from_json(text, "the RNG state (rng)")
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(_text_tensor(state["torch"]))
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(_text_tensor(state["cuda"]))


def saved_data_position(metadata: Metadata) -> dict[str, Any]:
    """A template of the data position with the checkpoint's keys (from its DCP ``metadata``), not this run's.

    The keys differ between loaders and settings: a held-out split adds one, a
    streamed hub dataset keeps one entry per DP rank. Shaped like the checkpoint, the
    read always succeeds, and the dataset's ``load_state_dict`` then says in its own
    words when the position does not map onto this run (shaped like this run, a
    missing key was DCP's error, and an extra one in the checkpoint went unnoticed).
    """
    template: dict[str, Any] = {}
    for keys in metadata.planner_data.values():
        if keys[0] != "dataloader":
            continue
        node = template
        for key in keys[1:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = None
    return template


def _optimizer_state(h: Holders) -> dict[str, Any]:
    # On a load, only when the optimizer is loaded: getting its state dict initializes its state.
    return get_optimizer_state_dict(h.model, h.optimizer, options=OPTIM_OPTIONS)


def _nothing(h: Holders, value: object) -> None:
    """The train state is not set on a holder: the loader returns its step."""


BUILTIN: tuple[StateSpec, ...] = (
    # Float8's cast-on-gather weights as the plain tensors they wrap: no torchao class in a checkpoint.
    StateSpec("model", save=lambda h, step: plain_weights(get_model_state_dict(h.model)),
              template=lambda h, saved: plain_weights(get_model_state_dict(h.model)),
              apply=lambda h, value: set_model_state_dict(h.model, value), model_only=True),
    StateSpec("optimizer", save=lambda h, step: _optimizer_state(h), template=lambda h, saved: _optimizer_state(h),
              apply=lambda h, value: set_optimizer_state_dict(h.model, h.optimizer, value, options=OPTIM_OPTIONS)),
    # JSON text, one value: DCP would otherwise flatten its nested lists and dicts.
    StateSpec("lr_scheduler", save=lambda h, step: to_json(h.lr_scheduler.state_dict()),
              template=lambda h, saved: "",
              apply=lambda h, value: h.lr_scheduler.load_state_dict(from_json(value, "the LR schedule"))),
    StateSpec("dataloader", save=lambda h, step: h.dataset.state_dict(),
              template=lambda h, saved: saved_data_position(saved()),
              apply=lambda h, value: h.dataset.load_state_dict(value)),
    StateSpec("train_state", save=lambda h, step: {"step": step}, template=lambda h, saved: {"step": 0},
              apply=_nothing, when_missing=FROM_STEP_0),
    StateSpec("rng", save=lambda h, step: {f"rank{h.rank}": _rng_state()},
              template=lambda h, saved: {f"rank{h.rank}": ""},
              apply=lambda h, value: _set_rng_state(value[f"rank{h.rank}"]), same_layout_only=True),
)
# Every run's states, in saving order; ``--checkpoint.exclude_from_loading`` names a subset of these.
STATE_KEYS: tuple[str, ...] = tuple(spec.name for spec in BUILTIN)


def extra_state(name: str, stateful: Any) -> StateSpec:
    """A run's own state (an object with ``state_dict``/``load_state_dict``), loaded in place by DCP.

    A checkpoint that lacks it leaves it fresh; a run without it skips it in a checkpoint that holds it.
    """
    if name in STATE_KEYS:
        raise ValueError(f"checkpoint extra state '{name}' has the name of a built-in state; rename it")
    return StateSpec(name, save=lambda h, step: stateful.state_dict(), template=lambda h, saved: stateful.state_dict(),
                     apply=lambda h, value: stateful.load_state_dict(value))


class StateRegistry:
    """This run's states: the built-in ones, then its extra states, each by name."""

    def __init__(self, holders: Holders, extra_states: dict[str, Any] | None = None) -> None:
        self.holders = holders
        self.extra_names = sorted(extra_states or {})
        self.specs: dict[str, StateSpec] = {spec.name: spec for spec in BUILTIN}
        for name, stateful in (extra_states or {}).items():
            self.specs[name] = extra_state(name, stateful)

    def names(self, model_only: bool) -> list[str]:
        """The manifest's ``states`` of a checkpoint: built-in ones alphabetically, then the extra ones."""
        builtin = sorted(spec.name for spec in BUILTIN if spec.model_only or not model_only)
        return builtin + ([] if model_only else self.extra_names)

    def save_state(self, step: int, model_only: bool) -> dict[str, Any]:
        """The DCP state dict a save writes (model-only: the model alone)."""
        return {name: spec.save(self.holders, step) for name, spec in self.specs.items()
                if spec.model_only or not model_only}

    def template(self, wanted: list[str], saved_metadata: Callable[[], Any]) -> dict[str, Any]:
        """What a load reads, for the ``wanted`` states, in registry order; DCP fills it in place."""
        return {name: spec.template(self.holders, saved_metadata) for name, spec in self.specs.items()
                if name in wanted}

    def resumed_step(self, step: int, wanted: list[str]) -> int:
        """The step a load of the ``wanted`` states continues after: 0 when a ``FROM_STEP_0`` state is not loaded."""
        restarts = [name for name, spec in self.specs.items()
                    if spec.when_missing == FROM_STEP_0 and name not in wanted]
        return 0 if restarts else step

    def apply(self, state: dict[str, Any]) -> None:
        """Set every loaded state, in registry order."""
        for name, spec in self.specs.items():
            if name in state:
                spec.apply(self.holders, state[name])
        forget_precomputed_scales(self.holders.model)  # computed from the weights before the load
