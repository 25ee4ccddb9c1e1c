"""Qwen3's ``ModelSpec`` (``--model.name=qwen3``): dense Qwen3 and Qwen3-MoE, configurations of the decoder.

A Qwen3 or Qwen3-MoE Hugging Face folder works as ``--model.flavor DIR``.
"""

from __future__ import annotations

from torchtitan.models.common.decoder import Decoder
from torchtitan.models.common.hf import DecoderHFAdapter
from torchtitan.models.common.hf_config import QWEN3_EXPERTS, HFDecoderConfig
from torchtitan.models.common.weight_map import WeightMap, decoder_templates
from torchtitan.models.qwen3.args import Qwen3Args, qwen3_flavors
from torchtitan.models.registry import register_model_spec
from torchtitan.models.spec import ModelSpec

CONFIG = HFDecoderConfig(Qwen3Args, ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"), ("qwen3", "qwen3_moe"),
                         QWEN3_EXPERTS)
WEIGHTS = WeightMap(decoder_templates("mlp", ("gate_proj", "down_proj", "up_proj")))

SPEC = ModelSpec(name="qwen3", model=Decoder, args_type=Qwen3Args, flavors=qwen3_flavors, read_release=CONFIG.read,
                 state_dict_adapter=DecoderHFAdapter(WEIGHTS, CONFIG))
register_model_spec(SPEC)
