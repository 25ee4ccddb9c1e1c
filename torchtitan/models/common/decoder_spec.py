"""The ``ModelSpec`` of a decoder family: ``decoder_spec`` from the family's own parts (its args type,
flavors, release reader, Hugging Face adapter and, for Llama 3, Meta's reader).

Everything else the rest of the code asks of a family (build, FLOPs, the TP plan, the attention backend,
the pipeline split, the preflight checks, the experts) is the one decoder's, so no family writes it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from torchtitan.config import JobConfig
from torchtitan.models.common import parallel
from torchtitan.models.common.config import DecoderConfig
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.common.flops import flops_per_token
from torchtitan.models.moe import moe_layers
from torchtitan.models.moe.assumed import assume_routing
from torchtitan.models.spec import ExpertSpec, MetaRelease, ModelSpec, StateDictAdapter


def _hidden_width(args: DecoderConfig) -> int:
    return args.dim  # the residual stream


def _with_moe_options(args: DecoderConfig, cfg: JobConfig) -> DecoderConfig:
    """The job's [moe] section (balancing) applied to the args of a model with experts."""
    if not args.num_experts:
        return args
    m = cfg.moe
    # The args are a dataclass (DecoderArgs) with these fields whenever the model has experts.
    return dataclasses.replace(args, load_balance_coeff=m.load_balance_coeff or 0.0,
                               aux_loss=m.aux_loss, aux_loss_coeff=m.aux_loss_coeff if m.aux_loss != "none" else 0.0)


# module-level functions: the planner pickles the spec to its worker processes
DECODER_EXPERTS = ExpertSpec(with_moe_options=_with_moe_options, apply_ep=parallel.apply_ep,
                             split_over_tp=parallel.split_moe_over_tp, layers=moe_layers,
                             assume_routing=assume_routing)


def decoder_spec(name: str, args_type: type, flavors: Mapping[str, DecoderConfig],
                 read_release: Callable[[str], DecoderConfig], adapter: StateDictAdapter, *,
                 meta_release: MetaRelease | None = None, experts: bool = False) -> ModelSpec:
    """A family's spec: its own parts, and the decoder's functions for the rest (``experts``: the family
    has models with experts)."""
    return ModelSpec(
        name=name,
        args_type=args_type,
        flavors=flavors,
        read_release=read_release,
        build=Decoder,
        flops_per_token=flops_per_token,
        apply_tp=parallel.apply_tp,
        use_attention=parallel.use_attention,
        prune_stage=parallel.prune_stage,
        hidden_width=_hidden_width,
        check=parallel.check,
        state_dict_adapter=adapter,
        meta_release=meta_release,
        supports_kv_cache=True,  # the decoder's cached forward (models/kv_cache.py)
        experts=DECODER_EXPERTS if experts else None,
    )
