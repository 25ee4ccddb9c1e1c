"""The ``ModelSpec`` of a decoder family: ``decoder_spec`` for any (Llama 3 passes its own functions), and
``decoder_model_spec`` for a family built on the shared MoE decoder (``moe_decoder.py``).

Every decoder keeps the same pipeline split, hidden width between stages, CPU kernel swap (of its own
attention class) and cached forward. Qwen3 and Mixtral differ only in their arguments, flavors, release
reader and Hugging Face names; everything else the rest of the code asks of them (build, FLOPs, the TP
plan, the CP binding, the preflight checks, the experts) is the shared decoder's.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.common import hf_config, parallel
from torchtitan.models.common.hf import DecoderHFAdapter
from torchtitan.models.common.moe_decoder import MoEDecoder, flops_per_token
from torchtitan.models.layers import Attention
from torchtitan.models.moe import moe_layers
from torchtitan.models.moe.assumed import assume_routing
from torchtitan.models.spec import ModelSpec, StateDictAdapter
from torchtitan.ops.cpu_kernels import use_cpu_kernels


def _use_cpu_kernels(attention: type[nn.Module], model: nn.Module, onednn_linears: bool) -> dict[str, int]:
    return use_cpu_kernels(model, attention, onednn_linears=onednn_linears)


def _hidden_width(args: Any) -> int:
    return args.dim  # the residual stream


def check(args: Any, dims: ParallelDims, cfg: JobConfig) -> list[str]:
    """The shared decoder's preflight problems (``parallel.check_decoder``) for the job's layout."""
    return parallel.check_decoder(args, dims.tp, cfg.parallelism.pipeline_parallel_degree, cfg.model.flavor,
                                  ep=dims.ep)


def _num_experts(args: Any) -> int:
    return args.num_experts


def _with_moe_options(args: Any, cfg: JobConfig) -> Any:
    """The job's [moe] section (balancing) applied to the args of a model with experts."""
    if not args.num_experts:
        return args
    m = cfg.moe
    return dataclasses.replace(args, load_balance_coeff=m.load_balance_coeff or 0.0, aux_loss=m.aux_loss,
                               aux_loss_coeff=m.aux_loss_coeff if m.aux_loss != "none" else 0.0)


def decoder_spec(name: str, args_type: type, flavors: Mapping[str, Any], read_release: Callable[[str], Any], *,
                 build: Callable[[Any], nn.Module], flops_per_token: Callable[[Any, int], float],
                 attention: type[nn.Module], apply_tp: Callable[..., None],
                 apply_cp: Callable[[nn.Module, DeviceMesh, int], None],
                 check: Callable[[Any, ParallelDims, JobConfig], list[str]],
                 state_dict_adapter: StateDictAdapter) -> ModelSpec:
    """A decoder family's spec from its own functions (``ModelSpec``'s fields of the same names);
    ``attention`` is the class of its attention layers, which take the eager CPU kernels."""
    return ModelSpec(
        name=name,
        args_type=args_type,
        flavors=flavors,
        read_release=read_release,
        build=build,
        flops_per_token=flops_per_token,
        # module-level functions and their partials: the planner pickles the spec to its worker processes
        use_cpu_kernels=functools.partial(_use_cpu_kernels, attention),
        apply_tp=apply_tp,
        apply_cp=apply_cp,
        prune_stage=parallel.prune_stage,
        hidden_width=_hidden_width,
        check=check,
        state_dict_adapter=state_dict_adapter,
        supports_kv_cache=True,  # the decoder's cached forward (models/kv_cache.py)
    )


def decoder_model_spec(name: str, args_type: type, flavors: dict[str, Any],
                       read_release: Callable[[str | Path], Any], naming: Any,
                       write_config: Callable[..., dict], qwen: bool) -> ModelSpec:
    """A family on the shared decoder: ``naming`` and ``write_config`` give its Hugging Face names and
    config.json; ``qwen`` selects the Qwen field spellings when reading one."""
    adapter = DecoderHFAdapter(naming, write_config, functools.partial(hf_config.fields_of_config, qwen=qwen),
                               hf_config.fields_of_args)
    spec = decoder_spec(name, args_type, flavors, read_release, build=MoEDecoder, flops_per_token=flops_per_token,
                        attention=Attention, apply_tp=parallel.apply_moe_decoder_tp, apply_cp=parallel.apply_cp,
                        check=check, state_dict_adapter=adapter)
    return with_experts(spec)


def with_experts(spec: ModelSpec) -> ModelSpec:
    """``spec`` with the shared MoE's expert functions: counts, the [moe] options, EP, balancing, the dry run."""
    return dataclasses.replace(spec, num_experts=_num_experts, with_moe_options=_with_moe_options,
                               apply_ep=parallel.apply_moe_decoder_ep, expert_layers=moe_layers,
                               assume_routing=assume_routing)
