"""Mixtral's ``ModelSpec`` (``--model.name=mixtral``), a configuration of the decoder. A Mixtral Hugging Face
folder works as ``--model.flavor DIR``."""

from __future__ import annotations

from torchtitan.models.common.decoder_spec import decoder_spec
from torchtitan.models.common.hf import DecoderHFAdapter
from torchtitan.models.common.hf_config import MIXTRAL_EXPERTS, HFDecoderConfig
from torchtitan.models.common.weight_map import WeightMap, decoder_templates
from torchtitan.models.mixtral.args import MixtralArgs, mixtral_flavors
from torchtitan.models.registry import register_model_spec

CONFIG = HFDecoderConfig(MixtralArgs, ("MixtralForCausalLM",), ("mixtral",), MIXTRAL_EXPERTS)
WEIGHTS = WeightMap(decoder_templates("block_sparse_moe", ("w1", "w2", "w3")))

SPEC = decoder_spec("mixtral", MixtralArgs, mixtral_flavors, CONFIG.read, DecoderHFAdapter(WEIGHTS, CONFIG),
                    experts=True)
register_model_spec(SPEC)
