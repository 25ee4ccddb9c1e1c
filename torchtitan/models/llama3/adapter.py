"""Llama 3's release formats: its Hugging Face ``config.json`` (``LlamaConfig``) and Meta's own release.

The Hugging Face weight names are the decoder's declarative map (``models/common/weight_map.py``);
this module adds what only Llama 3 has: the ``config.json`` with Llama 3.1 rotary scaling, and Meta's
``params.json`` with ``consolidated.*.pth`` shards, whose tensor names are ours.
"""

from __future__ import annotations

from collections.abc import Container

import torch

from torchtitan.models.common.config import DecoderConfig, JsonObject
from torchtitan.models.llama3 import convert
from torchtitan.models.llama3.args import ModelArgs

# Meta's model-parallel shards: the dim each parameter is split along (absent: replicated).
_META_SPLIT_DIM = {"tok_embeddings": 0, "output": 0, "wq": 0, "wk": 0, "wv": 0, "w1": 0, "w3": 0, "wo": 1, "w2": 1}
_EMBEDDING, _OUTPUT = "tok_embeddings.weight", "output.weight"


def _llama(args: DecoderConfig) -> ModelArgs:
    if not isinstance(args, ModelArgs):
        raise TypeError(f"{type(args).__name__} is not Llama 3's arguments")
    return args


class LlamaConfigFormat:
    """``HFConfigFormat`` of ``LlamaForCausalLM``: its table (``convert.LLAMA_CONFIG``), differences named as
    for Meta's ``params.json``."""

    table = convert.LLAMA_CONFIG

    def write(self, args: DecoderConfig, *, bos_id: int | None, eos_id: int | None, dtype: torch.dtype) -> JsonObject:
        return convert.hf_config(_llama(args), bos_id=bos_id, eos_id=eos_id, dtype=dtype)

    def problems(self, args: DecoderConfig, config: JsonObject, source: str) -> list[str]:
        return convert.field_differences(convert.model_fields(_llama(args)), convert.fields_from_hf_config(config),
                                         source)


class MetaReader:
    """``MetaRelease`` of Llama 3: ``params.json`` and ``consolidated.NN.pth`` model-parallel shards."""

    def params_problems(self, args: DecoderConfig, params: JsonObject, source: str) -> list[str]:
        llama = _llama(args)
        return convert.field_differences(convert.model_fields(llama), convert.fields_from_meta_params(params, llama),
                                         source)

    def split_dim(self, fqn: str) -> int | None:
        return _META_SPLIT_DIM.get(fqn.split(".")[-2])

    def name(self, fqn: str, args: DecoderConfig, present: Container[str]) -> str:
        if fqn == _OUTPUT and (args.tie_word_embeddings or fqn not in present):
            return _EMBEDDING  # tied: one weight, whether the release stores it once or twice
        return fqn

    def shapes(self, shapes: dict[str, tuple[int, ...]], expected: Container[str],
               args: DecoderConfig) -> dict[str, tuple[int, ...]]:
        # Layer weights beyond the expected ones stay in, so that a release with more layers is named.
        saved = {k: v for k, v in shapes.items()
                 if k in expected or (k.startswith("layers.") and k.endswith(".weight"))}
        if args.tie_word_embeddings and _OUTPUT not in saved and _EMBEDDING in saved:
            saved[_OUTPUT] = saved[_EMBEDDING]  # stored once; name() maps it
        return saved
