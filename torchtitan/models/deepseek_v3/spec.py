"""DeepSeek-V3's ``ModelSpec`` (``--model.name=deepseek_v3``): MLA blocks on the shared decoder's machinery
(pipeline split, CP binding, experts and expert parallelism, cached forward).

A DeepSeek-V3, Kimi K2 or Moonlight Hugging Face folder works as ``--model.flavor DIR``.
"""

from __future__ import annotations

import dataclasses

from torchtitan.models.common import parallel as common_parallel
from torchtitan.models.common.decoder_spec import decoder_spec, with_experts
from torchtitan.models.deepseek_v3 import parallel
from torchtitan.models.deepseek_v3.args import DeepSeekV3Args, deepseek_v3_flavors
from torchtitan.models.deepseek_v3.hf import DeepSeekV3HFAdapter, read_release
from torchtitan.models.deepseek_v3.mla import MultiHeadLatentAttention
from torchtitan.models.deepseek_v3.model import DeepSeekV3Model, flops_per_token
from torchtitan.models.registry import register_model_spec

_SPEC = with_experts(decoder_spec(
    "deepseek_v3", DeepSeekV3Args, deepseek_v3_flavors, read_release, build=DeepSeekV3Model,
    flops_per_token=flops_per_token,  # type: ignore[arg-type]  # takes the family's own args
    attention=MultiHeadLatentAttention, apply_tp=parallel.apply_tp, apply_cp=common_parallel.apply_cp,
    check=parallel.check,  # type: ignore[arg-type]  # takes the family's own args
    state_dict_adapter=DeepSeekV3HFAdapter()))
SPEC = dataclasses.replace(_SPEC, with_moe_options=parallel.with_job_options)  # [moe] and --model.mtp_*
register_model_spec(SPEC)
