"""GPT-OSS's ``ModelSpec`` (``--model.name=gpt_oss``): the one decoder with sink attention and GPT-OSS's MoE, in
its own model class (``GptOssModel``: its FLOPs, and its TP plan, where the sinks follow the heads), and its
Hugging Face layout. A GPT-OSS Hugging Face folder (MXFP4 or not) works as ``--model.flavor DIR``."""

from __future__ import annotations

from torchtitan.models.gpt_oss.args import GptOssArgs, gpt_oss_flavors
from torchtitan.models.gpt_oss.hf import GptOssHFAdapter, read_release
from torchtitan.models.gpt_oss.model import GptOssModel
from torchtitan.models.registry import register_model_spec
from torchtitan.models.spec import ModelSpec

SPEC = ModelSpec(name="gpt_oss", model=GptOssModel, args_type=GptOssArgs, flavors=gpt_oss_flavors,
                 read_release=read_release, state_dict_adapter=GptOssHFAdapter())
register_model_spec(SPEC)
