"""What the rest of the code asks of a model family: one ``ModelSpec`` per family.

The trainer, preflight, evaluation, the planner and the checkpoint formats never import a family;
they look its spec up by ``model.name`` (``torchtitan/models/registry.py``) and go through it. A
family lives in ``torchtitan/models/<family>/`` and registers its spec there (docs/models.md says
how to add one). A family is a class: its ``model`` is the one decoder (``models/common/decoder.py``)
or a subclass overriding what differs, its arguments a dataclass subclassing the abstract root
``DecoderConfig``; the spec adds the family's own flavors, release reader and weight names.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch
from torch import nn

from torchtitan.models.common.config import DecoderConfig, JsonObject
from torchtitan.models.common.decoder import Decoder

# A family's hyper-parameters (models/common/config.py); covariant: a spec of Qwen3Args is a spec of DecoderConfig.
ArgsT = TypeVar("ArgsT", bound=DecoderConfig, covariant=True)


def family_model(part: nn.Module, user: str) -> Decoder:
    """``part`` (the whole model or a pipeline stage of it) as the generic code asks it; TypeError naming
    ``user`` for a module that no family built."""
    if not isinstance(part, Decoder):
        raise TypeError(f"{user} takes a model part that a family built (a Decoder), not a {type(part).__name__}")
    return part


def prune_stage(stage: nn.Module, layers: range, first: bool, last: bool) -> None:
    """Make ``stage``, a copy of the whole model, the pipeline stage keeping ``layers``: its family's
    ``Decoder.prune_stage`` (the callback distributed/pipeline_parallel.py takes)."""
    family_model(stage, "prune_stage").prune_stage(layers, first, last)


@dataclass(frozen=True)
class HFConversion:
    """One of our parameters made from a release's tensors by more than renaming and stacking (GPT-OSS's
    transposed, interleaved or MXFP4-packed experts): its full shape, and a reader of its full value."""

    shape: tuple[int, ...]
    read: Callable[[], torch.Tensor]


class StateDictAdapter(Protocol):
    """A family's names and layouts in Hugging Face releases. Reading is ``checkpoint/formats.py``'s alone,
    tensor by tensor, from these answers: no whole-dict conversion into our names exists to drift from it."""

    # ``quantization_config`` methods whose tensors ``hf_conversion`` dequantizes (GPT-OSS: mxfp4)
    quant_methods: frozenset[str]

    def to_hf(self, state: dict[str, torch.Tensor], args: DecoderConfig) -> dict[str, torch.Tensor]:
        """Our full state dict -> Hugging Face names and layout."""
        ...

    def hf_name(self, fqn: str, tied: bool) -> str:
        """The Hugging Face tensor that holds our parameter ``fqn`` (``tied``: the release ties embeddings)."""
        ...

    def hf_expert_names(self, fqn: str, args: DecoderConfig) -> list[str] | None:
        """The per-expert Hugging Face tensors of our stacked ``fqn`` ([E, ...]), in order (None: not stacked)."""
        ...

    def hf_permuted_heads(self, fqn: str, args: DecoderConfig) -> int | None:
        """Heads whose rows Hugging Face stores in another order in ``fqn`` (None: stored alike)."""
        ...

    def rows_from_hf(self, fqn: str, w: torch.Tensor, heads: int) -> torch.Tensor:
        """Whole heads' rows of ``fqn`` from Hugging Face's order into ours."""
        ...

    def hf_conversion(self, fqn: str, args: DecoderConfig, shapes: Mapping[str, tuple[int, ...]],
                      read: Callable[[str], torch.Tensor]) -> HFConversion | None:
        """How our ``fqn`` is made from the release's tensors (``shapes`` by name; ``read`` one whole) when
        renaming, stacking and ``rows_from_hf`` do not say it; None: they do."""
        ...

    def hf_config(self, args: DecoderConfig, *, bos_id: int | None, eos_id: int | None,
                  dtype: torch.dtype) -> JsonObject:
        """A ``config.json`` describing ``args``."""
        ...

    def hf_config_problems(self, args: DecoderConfig, config: JsonObject, source: str) -> list[str]:
        """One line per shape in which a ``config.json`` differs from ``args``."""
        ...


class MetaRelease(Protocol):
    """Meta's ``params.json`` and ``consolidated.*.pth`` (Llama 3's own reader)."""

    def params_problems(self, args: DecoderConfig, params: JsonObject, source: str) -> list[str]:
        """One line per shape in which ``params.json`` differs from ``args``."""
        ...

    def split_dim(self, fqn: str) -> int | None:
        """The dim along which Meta's model-parallel shards split ``fqn`` (None: replicated)."""
        ...

    def name(self, fqn: str, args: DecoderConfig, present: Container[str]) -> str:
        """The tensor of a release that holds our ``fqn`` (``present``: the names the release has)."""
        ...

    def shapes(self, shapes: dict[str, tuple[int, ...]], expected: Container[str],
               args: DecoderConfig) -> dict[str, tuple[int, ...]]:
        """A release's parameter shapes under our names, for comparison with ``expected``."""
        ...


@dataclass(frozen=True)
class ModelSpec(Generic[ArgsT]):
    """Everything the rest of the code asks of one model family (see the module docstring): its data here, its
    behaviour in ``model``, the family's ``Decoder`` class."""

    name: str  # --model.name
    # the model class: built from args on the current default device (the meta device in the trainer); its
    # classmethods answer from args alone (FLOPs, preflight checks, the job's options), its methods parallelize a
    # model part (TP plan, attention backend, pipeline pruning, experts); its param_init_specs() are the init
    model: type[Decoder]
    args_type: type[ArgsT]  # the family's own DecoderConfig subclass (not an abstract one)
    # ---- sizes: named flavors, and a release's config.json / params.json read into args
    flavors: Mapping[str, ArgsT]
    read_release: Callable[[str], ArgsT]  # ValueError (one line) for what the family cannot represent
    # ---- weights in Hugging Face releases, and Meta's (None: the family has none)
    state_dict_adapter: StateDictAdapter
    meta_release: MetaRelease | None = None

    def __post_init__(self) -> None:
        if inspect.isabstract(self.args_type):
            raise TypeError(f"model family {self.name!r}: args_type {self.args_type.__name__} is abstract (the shared "
                            "root or base of families' arguments); give the family's own args class")

    def build(self, args: DecoderConfig) -> Decoder:
        """The family's model of ``args`` (on the current default device)."""
        return self.model(args)
