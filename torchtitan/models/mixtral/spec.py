"""Mixtral's ``ModelSpec`` (``--model.name=mixtral``), a configuration of the decoder. A Mixtral Hugging Face
folder works as ``--model.flavor DIR``."""

from __future__ import annotations

from torchtitan.models.common.decoder import Decoder
from torchtitan.models.common.hf import DecoderHFAdapter
from torchtitan.models.common.hf_config import MIXTRAL_EXPERTS, HFDecoderConfig
from torchtitan.models.common.weight_map import WeightMap, decoder_templates
from torchtitan.models.mixtral.args import MixtralArgs, mixtral_flavors
from torchtitan.models.registry import register_model_spec
from torchtitan.models.spec import ModelSpec

CONFIG = HFDecoderConfig(MixtralArgs, ("MixtralForCausalLM",), ("mixtral",), MIXTRAL_EXPERTS)
WEIGHTS = WeightMap(decoder_templates("block_sparse_moe", ("w1", "w2", "w3")))

SPEC = ModelSpec(name="mixtral", model=Decoder, args_type=MixtralArgs, flavors=mixtral_flavors,
                 read_release=CONFIG.read, state_dict_adapter=DecoderHFAdapter(WEIGHTS, CONFIG))
register_model_spec(SPEC)
