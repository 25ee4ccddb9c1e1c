"""Llama 3's ``StateDictAdapter``: its names and layouts in Hugging Face and Meta releases.

The mapping itself is ``convert.py`` (pure functions); this class is what the checkpoint formats
(``torchtitan/checkpoint/formats.py``) reach through the family's spec.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping
from typing import TYPE_CHECKING, Any

import torch

from torchtitan.models.llama3 import convert
from torchtitan.models.llama3.args import ModelArgs

if TYPE_CHECKING:
    from torchtitan.models.spec import HFConversion

# Meta's model-parallel shards: the dim each parameter is split along (absent: replicated).
_META_SPLIT_DIM = {"tok_embeddings": 0, "output": 0, "wq": 0, "wk": 0, "wv": 0, "w1": 0, "w3": 0, "wo": 1, "w2": 1}
_EMBEDDING, _OUTPUT = "tok_embeddings.weight", "output.weight"


class Llama3StateDictAdapter:
    """Hugging Face ``LlamaForCausalLM`` and Meta's ``consolidated.*.pth`` names and layouts."""

    def to_hf(self, state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
        return convert.state_dict_to_hf(state, args)

    def from_hf(self, state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
        return convert.state_dict_from_hf(state, args)

    def hf_name(self, fqn: str, tied: bool) -> str:
        if fqn == _OUTPUT and tied:
            # Tied: the output projection is the embedding, as transformers reads it (an lm_head.weight
            # some exports carry beside it is ignored there too).
            return convert.to_hf_name(_EMBEDDING)
        return convert.to_hf_name(fqn)

    def hf_expert_names(self, fqn: str, args: ModelArgs) -> list[str] | None:
        return None  # a dense family

    def hf_permuted_heads(self, fqn: str, args: ModelArgs) -> int | None:
        return convert.rotary_heads(fqn, args)

    def hf_conversion(self, fqn: str, args: ModelArgs, shapes: Mapping[str, tuple[int, ...]],
                      read: Callable[[str], torch.Tensor]) -> HFConversion | None:
        return None  # every tensor is renamed, stacked or permuted by rows

    def rows_from_hf(self, w: torch.Tensor, heads: int) -> torch.Tensor:
        return convert.permute_from_hf(w, heads)

    def hf_config(self, args: ModelArgs, *, bos_id: int | None, eos_id: int | None,
                  dtype: torch.dtype) -> dict[str, Any]:
        return convert.hf_config(args, bos_id=bos_id, eos_id=eos_id, dtype=dtype)

    def hf_config_problems(self, args: ModelArgs, config: dict[str, Any], source: str) -> list[str]:
        return convert.field_differences(convert.model_fields(args), convert.fields_from_hf_config(config), source)

    def meta_params_problems(self, args: ModelArgs, params: dict[str, Any], source: str) -> list[str]:
        return convert.field_differences(convert.model_fields(args), convert.fields_from_meta_params(params, args),
                                         source)

    def meta_split_dim(self, fqn: str) -> int | None:
        return _META_SPLIT_DIM.get(fqn.split(".")[-2])

    def meta_name(self, fqn: str, args: ModelArgs, present: Container[str]) -> str:
        if fqn == _OUTPUT and (args.tie_word_embeddings or fqn not in present):
            return _EMBEDDING  # tied: one weight, whether the release stores it once or twice
        return fqn

    def meta_shapes(self, shapes: dict[str, tuple[int, ...]], expected: Container[str],
                    args: ModelArgs) -> dict[str, tuple[int, ...]]:
        # Layer weights beyond the expected ones stay in, so that a release with more layers is named.
        saved = {k: v for k, v in shapes.items()
                 if k in expected or (k.startswith("layers.") and k.endswith(".weight"))}
        if args.tie_word_embeddings and _OUTPUT not in saved and _EMBEDDING in saved:
            saved[_OUTPUT] = saved[_EMBEDDING]  # stored once; meta_name maps it
        return saved
