"""GPT-OSS's ``ModelSpec`` (``--model.name=gpt_oss``). A GPT-OSS Hugging Face folder (MXFP4 or not) works as
``--model.flavor DIR``."""

from __future__ import annotations

from torchtitan.models.common import decoder_spec, parallel
from torchtitan.models.gpt_oss import parallel as gpt_oss_parallel
from torchtitan.models.gpt_oss.args import GptOssArgs, gpt_oss_flavors
from torchtitan.models.gpt_oss.attention import SinkAttention
from torchtitan.models.gpt_oss.hf import GptOssHFAdapter, read_release
from torchtitan.models.gpt_oss.model import GptOssModel, flops_per_token
from torchtitan.models.registry import register_model_spec

SPEC = decoder_spec.with_experts(decoder_spec.decoder_spec(
    "gpt_oss", GptOssArgs, gpt_oss_flavors, read_release, build=GptOssModel, flops_per_token=flops_per_token,
    attention=SinkAttention, apply_tp=gpt_oss_parallel.apply_tp, apply_cp=parallel.apply_cp,
    check=decoder_spec.check, state_dict_adapter=GptOssHFAdapter()))
register_model_spec(SPEC)
