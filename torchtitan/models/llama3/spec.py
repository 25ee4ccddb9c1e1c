"""Llama 3's ``ModelSpec`` (``--model.name=llama3``): a configuration of the decoder with Llama 3's flavors,
its release reader (Hugging Face's config.json or Meta's params.json) and Meta's weights."""

from __future__ import annotations

from torchtitan.models.common.decoder import Decoder
from torchtitan.models.common.hf import DecoderHFAdapter
from torchtitan.models.common.weight_map import WeightMap, decoder_templates
from torchtitan.models.llama3.adapter import LlamaConfigFormat, MetaReader
from torchtitan.models.llama3.args import ModelArgs, llama3_flavors
from torchtitan.models.llama3.release import args_from_release
from torchtitan.models.registry import register_model_spec
from torchtitan.models.spec import ModelSpec

WEIGHTS = WeightMap(decoder_templates())
SPEC = ModelSpec(name="llama3", model=Decoder, args_type=ModelArgs, flavors=llama3_flavors,
                 read_release=args_from_release, state_dict_adapter=DecoderHFAdapter(WEIGHTS, LlamaConfigFormat()),
                 meta_release=MetaReader())
register_model_spec(SPEC)

__all__ = ["SPEC"]
