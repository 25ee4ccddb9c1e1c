"""GPT-OSS's ``ModelSpec`` (``--model.name=gpt_oss``): the one decoder with sink attention and GPT-OSS's MoE
(its own model class), its FLOPs, TP plan (the sinks follow the heads) and Hugging Face layout. A GPT-OSS
Hugging Face folder (MXFP4 or not) works as ``--model.flavor DIR``."""

from __future__ import annotations

import dataclasses

from torchtitan.models.common.decoder_spec import decoder_spec
from torchtitan.models.gpt_oss import parallel
from torchtitan.models.gpt_oss.args import GptOssArgs, gpt_oss_flavors
from torchtitan.models.gpt_oss.hf import GptOssHFAdapter, read_release
from torchtitan.models.gpt_oss.model import GptOssModel, flops_per_token
from torchtitan.models.registry import register_model_spec

SPEC = dataclasses.replace(
    decoder_spec("gpt_oss", GptOssArgs, gpt_oss_flavors, read_release, GptOssHFAdapter(), experts=True),
    build=GptOssModel, flops_per_token=flops_per_token, apply_tp=parallel.apply_tp)
register_model_spec(SPEC)
