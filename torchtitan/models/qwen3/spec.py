"""Qwen3's ``ModelSpec`` (``--model.name=qwen3``): dense Qwen3 and Qwen3-MoE on the shared decoder.

A Qwen3 or Qwen3-MoE Hugging Face folder works as ``--model.flavor DIR``.
"""

from __future__ import annotations

import functools
from pathlib import Path

from torch import nn

from torchtitan.config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.common import hf_config, parallel
from torchtitan.models.common.hf import QWEN3_NAMING, DecoderHFAdapter
from torchtitan.models.common.moe_decoder import MoEDecoder, flops_per_token
from torchtitan.models.layers import Attention
from torchtitan.models.qwen3.args import Qwen3Args, qwen3_flavors
from torchtitan.models.registry import register_model_spec
from torchtitan.models.spec import ModelSpec
from torchtitan.ops.cpu_kernels import use_cpu_kernels

ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


def read_release(path: str | Path) -> Qwen3Args:
    return hf_config.args_from_release(path, Qwen3Args, ARCHITECTURES, ("qwen3", "qwen3_moe"), qwen=True)


def _hf_config(args: Qwen3Args, **kw) -> dict:  # noqa: ANN003 - bos_id, eos_id, dtype
    moe = bool(args.num_experts)
    return hf_config.hf_config(args, architecture=ARCHITECTURES[moe], model_type="qwen3_moe" if moe else "qwen3",
                               qwen=True, **kw)


def _use_cpu_kernels(model: nn.Module, onednn_linears: bool) -> dict[str, int]:
    return use_cpu_kernels(model, Attention, onednn_linears=onednn_linears)


def check(args: Qwen3Args, dims: ParallelDims, cfg: JobConfig) -> list[str]:
    return parallel.check_decoder(args, dims.tp, cfg.parallelism.pipeline_parallel_degree, cfg.model.flavor)


SPEC = ModelSpec(
    name="qwen3",
    args_type=Qwen3Args,
    flavors=qwen3_flavors,
    read_release=read_release,
    build=MoEDecoder,
    flops_per_token=flops_per_token,
    use_cpu_kernels=_use_cpu_kernels,
    apply_tp=parallel.apply_moe_decoder_tp,
    apply_cp=parallel.apply_cp,
    prune_stage=parallel.prune_stage,
    hidden_width=lambda args: args.dim,
    check=check,
    state_dict_adapter=DecoderHFAdapter(QWEN3_NAMING, _hf_config,
                                        functools.partial(hf_config.fields_of_config, qwen=True),
                                        hf_config.fields_of_args),
    supports_kv_cache=True,  # the shared decoder's cached forward (models/kv_cache.py)
)
register_model_spec(SPEC)
