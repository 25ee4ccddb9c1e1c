"""Mixtral's ``ModelSpec`` (``--model.name=mixtral``). A Mixtral Hugging Face folder works as
``--model.flavor DIR``."""

from __future__ import annotations

import functools
from pathlib import Path

from torch import nn

from torchtitan.config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.common import hf_config, parallel
from torchtitan.models.common.hf import MIXTRAL_NAMING, DecoderHFAdapter
from torchtitan.models.common.moe_decoder import MoEDecoder, flops_per_token
from torchtitan.models.layers import Attention
from torchtitan.models.mixtral.args import MixtralArgs, mixtral_flavors
from torchtitan.models.registry import register_model_spec
from torchtitan.models.spec import ModelSpec
from torchtitan.ops.cpu_kernels import use_cpu_kernels

ARCHITECTURES = ("MixtralForCausalLM",)


def read_release(path: str | Path) -> MixtralArgs:
    return hf_config.args_from_release(path, MixtralArgs, ARCHITECTURES, ("mixtral",), qwen=False)


def _hf_config(args: MixtralArgs, **kw) -> dict:  # noqa: ANN003 - bos_id, eos_id, dtype
    return hf_config.hf_config(args, architecture=ARCHITECTURES[0], model_type="mixtral", qwen=False, **kw)


def _use_cpu_kernels(model: nn.Module, onednn_linears: bool) -> dict[str, int]:
    return use_cpu_kernels(model, Attention, onednn_linears=onednn_linears)


def check(args: MixtralArgs, dims: ParallelDims, cfg: JobConfig) -> list[str]:
    return parallel.check_decoder(args, dims.tp, cfg.parallelism.pipeline_parallel_degree, cfg.model.flavor)


SPEC = ModelSpec(
    name="mixtral",
    args_type=MixtralArgs,
    flavors=mixtral_flavors,
    read_release=read_release,
    build=MoEDecoder,
    flops_per_token=flops_per_token,
    use_cpu_kernels=_use_cpu_kernels,
    apply_tp=parallel.apply_moe_decoder_tp,
    apply_cp=parallel.apply_cp,
    prune_stage=parallel.prune_stage,
    hidden_width=lambda args: args.dim,
    check=check,
    state_dict_adapter=DecoderHFAdapter(MIXTRAL_NAMING, _hf_config,
                                        functools.partial(hf_config.fields_of_config, qwen=False),
                                        hf_config.fields_of_args),
    supports_kv_cache=True,  # the shared decoder's cached forward (models/kv_cache.py)
)
register_model_spec(SPEC)
