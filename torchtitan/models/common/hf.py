"""The decoder's weights and config under Hugging Face names: every family's ``StateDictAdapter``.

Pure functions, no file I/O (that is ``torchtitan/checkpoint/formats.py``). The names and layouts are a
declarative ``WeightMap`` (``weight_map.py``): experts are stacked here (``experts.w1 [E, F, D]``) and one
tensor per expert there; q/k rows (and a query/key norm's entries) are permuted within each head for the
rotary layout. A family gives its rows and its ``config.json`` format (``HFConfigFormat``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import torch

from torchtitan.models.common.config import DecoderConfig, JsonObject
from torchtitan.models.common.weight_map import WeightMap
from torchtitan.models.spec import HFConversion


class HFConfigFormat(Protocol):
    """A family's ``config.json``: written from args, and compared with args."""

    def write(self, args: DecoderConfig, *, bos_id: int | None, eos_id: int | None, dtype: torch.dtype) -> JsonObject:
        ...

    def problems(self, args: DecoderConfig, config: JsonObject, source: str) -> list[str]:
        """One line per shape in which ``config`` differs from ``args``."""
        ...


class DecoderHFAdapter:
    """The ``StateDictAdapter`` (models/spec.py) of a decoder family: its ``WeightMap`` and config format."""

    quant_methods: frozenset[str] = frozenset()  # no quantization of its own (FP8 blocks are read generically)

    def __init__(self, weights: WeightMap, config: HFConfigFormat):
        self.weights, self.config = weights, config

    def hf_name(self, fqn: str, tied: bool) -> str:
        return self.weights.hf_name(fqn, tied)

    def hf_expert_names(self, fqn: str, args: DecoderConfig) -> list[str] | None:
        return self.weights.hf_expert_names(fqn, args)

    def hf_permuted_heads(self, fqn: str, args: DecoderConfig) -> int | None:
        return self.weights.hf_permuted_heads(fqn, args)

    def hf_conversion(self, fqn: str, args: DecoderConfig, shapes: Mapping[str, tuple[int, ...]],
                      read: Callable[[str], torch.Tensor]) -> HFConversion | None:
        return self.weights.hf_conversion(fqn, shapes, read)

    def rows_from_hf(self, fqn: str, w: torch.Tensor, heads: int) -> torch.Tensor:
        return self.weights.rows_from_hf(w, heads, self.weights.rotary_dims(fqn))

    def to_hf(self, state: dict[str, torch.Tensor], args: DecoderConfig) -> dict[str, torch.Tensor]:
        return self.weights.to_hf(state, args)

    def hf_config(self, args: DecoderConfig, *, bos_id: int | None, eos_id: int | None,
                  dtype: torch.dtype) -> JsonObject:
        return self.config.write(args, bos_id=bos_id, eos_id=eos_id, dtype=dtype)

    def hf_config_problems(self, args: DecoderConfig, config: JsonObject, source: str) -> list[str]:
        return self.config.problems(args, config, source)
