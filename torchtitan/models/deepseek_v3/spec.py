"""DeepSeek-V3's ``ModelSpec`` (``--model.name=deepseek_v3``): the one decoder with MLA as its attention, its
own model class (the rotary cache over the rotary part, multi-token prediction), FLOPs and checks.

A DeepSeek-V3, Kimi K2 or Moonlight Hugging Face folder works as ``--model.flavor DIR``.
"""

from __future__ import annotations

import dataclasses

from torchtitan.models.common.decoder_spec import DECODER_EXPERTS, decoder_spec
from torchtitan.models.deepseek_v3 import parallel
from torchtitan.models.deepseek_v3.args import DeepSeekV3Args, deepseek_v3_flavors
from torchtitan.models.deepseek_v3.hf import DeepSeekV3HFAdapter, read_release
from torchtitan.models.deepseek_v3.model import DeepSeekV3Model, flops_per_token
from torchtitan.models.registry import register_model_spec

SPEC = dataclasses.replace(
    decoder_spec("deepseek_v3", DeepSeekV3Args, deepseek_v3_flavors, read_release, DeepSeekV3HFAdapter(),
                 experts=True),
    build=DeepSeekV3Model, flops_per_token=flops_per_token, check=parallel.check, prune_stage=parallel.prune_stage,
    apply_tp=parallel.apply_tp,  # + MLA's TP group
    release_holds_routing_bias=True,  # the release's e_score_correction_bias
    experts=dataclasses.replace(DECODER_EXPERTS, with_moe_options=parallel.with_job_options))  # + --model.mtp_*
register_model_spec(SPEC)
