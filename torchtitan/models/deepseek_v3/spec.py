"""DeepSeek-V3's ``ModelSpec`` (``--model.name=deepseek_v3``): the one decoder with MLA as its attention, in its
own model class (``DeepSeekV3Model``: the rotary cache over the rotary part, multi-token prediction, and the
FLOPs, checks, job options, TP plan and pipeline split that differ from the decoder's).

A DeepSeek-V3, Kimi K2 or Moonlight Hugging Face folder works as ``--model.flavor DIR``.
"""

from __future__ import annotations

from torchtitan.models.deepseek_v3.args import DeepSeekV3Args, deepseek_v3_flavors
from torchtitan.models.deepseek_v3.hf import DeepSeekV3HFAdapter, read_release
from torchtitan.models.deepseek_v3.model import DeepSeekV3Model
from torchtitan.models.registry import register_model_spec
from torchtitan.models.spec import ModelSpec

SPEC = ModelSpec(name="deepseek_v3", model=DeepSeekV3Model, args_type=DeepSeekV3Args, flavors=deepseek_v3_flavors,
                 read_release=read_release, state_dict_adapter=DeepSeekV3HFAdapter())
register_model_spec(SPEC)
