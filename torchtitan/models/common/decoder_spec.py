"""The ``ModelSpec`` of a family built on the shared MoE decoder (``moe_decoder.py``).

Qwen3 and Mixtral differ only in their arguments, flavors, release reader and Hugging Face names;
everything the rest of the code asks of them (build, FLOPs, the TP plan, the CP binding, the
pipeline split, the preflight checks, the cached forward) is the shared decoder's.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from torchtitan.config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.common import hf_config, parallel
from torchtitan.models.common.hf import DecoderHFAdapter
from torchtitan.models.common.moe_decoder import MoEDecoder, flops_per_token
from torchtitan.models.layers import Attention
from torchtitan.models.spec import ModelSpec
from torchtitan.ops.cpu_kernels import use_cpu_kernels


def _use_cpu_kernels(model: nn.Module, onednn_linears: bool) -> dict[str, int]:
    return use_cpu_kernels(model, Attention, onednn_linears=onednn_linears)


def _hidden_width(args: Any) -> int:
    return args.dim


def _check(args: Any, dims: ParallelDims, cfg: JobConfig) -> list[str]:
    return parallel.check_decoder(args, dims.tp, cfg.parallelism.pipeline_parallel_degree, cfg.model.flavor,
                                  ep=dims.ep)


def _num_experts(args: Any) -> int:
    return args.num_experts


def _with_moe_options(args: Any, cfg: JobConfig) -> Any:
    """The job's [moe] section (balancing) applied to the args of a model with experts."""
    if not args.num_experts:
        return args
    m = cfg.moe
    return dataclasses.replace(args, load_balance_coeff=m.load_balance_coeff, aux_loss=m.aux_loss,
                               aux_loss_coeff=m.aux_loss_coeff if m.aux_loss != "none" else 0.0)


def decoder_model_spec(name: str, args_type: type, flavors: dict[str, Any],
                       read_release: Callable[[str | Path], Any], naming: Any,
                       write_config: Callable[..., dict], qwen: bool) -> ModelSpec:
    """A family on the shared decoder: ``naming`` and ``write_config`` give its Hugging Face names and
    config.json; ``qwen`` selects the Qwen field spellings when reading one."""
    return ModelSpec(
        name=name,
        args_type=args_type,
        flavors=flavors,
        read_release=read_release,
        build=MoEDecoder,
        flops_per_token=flops_per_token,
        use_cpu_kernels=_use_cpu_kernels,
        apply_tp=parallel.apply_moe_decoder_tp,
        apply_cp=parallel.apply_cp,
        prune_stage=parallel.prune_stage,
        hidden_width=_hidden_width,  # module-level: the planner pickles the spec to its worker processes
        check=_check,
        state_dict_adapter=DecoderHFAdapter(naming, write_config,
                                            functools.partial(hf_config.fields_of_config, qwen=qwen),
                                            hf_config.fields_of_args),
        supports_kv_cache=True,  # the shared decoder's cached forward (models/kv_cache.py)
        num_experts=_num_experts,
        with_moe_options=_with_moe_options,
        apply_ep=parallel.apply_moe_decoder_ep,
    )
