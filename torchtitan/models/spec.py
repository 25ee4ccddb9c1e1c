"""What the rest of the code asks of a model family: one ``ModelSpec`` per family.

The trainer, preflight, evaluation, the planner and the checkpoint formats never import a family;
they look its spec up by ``model.name`` (``torchtitan/models/registry.py``) and go through it. A
family lives in ``torchtitan/models/<family>/`` and registers its spec there (docs/models.md says
how to add one). Every family is a configuration of the one decoder (``models/common``): its
arguments are a ``DecoderConfig`` dataclass, and the spec's functions are the decoder's, with the
family's own flavors, release reader and weight names.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.config import JobConfig
from torchtitan.distributed.init_spec import InitSpec
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.common.config import DecoderConfig, JsonObject
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.expert_balance import ExpertLayer

FamilyArgs = DecoderConfig  # a family's hyper-parameters (models/common/config.py)


class FamilyModel(Protocol):
    """What the generic code calls on a family's model (the whole model, or one pipeline stage of it)."""

    args: DecoderConfig
    layers: nn.ModuleDict  # the repeated blocks, keyed by their index in the whole model

    def param_init_specs(self) -> dict[str, InitSpec]:
        """FQN -> how to initialize it: the layout-invariant init (distributed/layout_init.py) reads it."""
        ...

    def init_weights(self, buffer_device: torch.device | None = None) -> None: ...

    def init_buffers(self, buffer_device: torch.device | None = None) -> None: ...

    def num_params(self, exclude_embedding: bool = False) -> int: ...

    tok_embeddings: nn.Embedding | None  # None on a pipeline stage without it

    def blocks(self) -> Sequence[nn.Module]:
        """The blocks of ``layers``, in order: each an FSDP unit (distributed/fsdp.py) and a compiled graph."""
        ...

    def extra_blocks(self) -> Sequence[nn.Module]:
        """Blocks that run after ``layers`` (DeepSeek-V3's MTP modules): FSDP units of their own, with a block's
        TP plan (the decoder's own)."""
        ...

    def moe_layers(self) -> Mapping[str, nn.Module]:
        """Layer key -> its MoE feed-forward (this part's sparse layers)."""
        ...

    # Generation (a spec with ``supports_kv_cache``): ``forward(tokens, cache=KVCache)`` takes the
    # rows' new tokens, appends their keys and values to the cache and returns their logits; the
    # args' ``max_seq_len`` is the longest sequence it takes.


def family_model(part: nn.Module, user: str) -> FamilyModel:
    """``part`` (the whole model or a pipeline stage of it) as the generic code asks it; TypeError naming
    ``user`` for a module that no family built."""
    if not isinstance(part, Decoder):
        raise TypeError(f"{user} takes a model part that a family built (a Decoder), not a {type(part).__name__}")
    return part


@dataclass(frozen=True)
class HFConversion:
    """One of our parameters made from a release's tensors by more than renaming and stacking (GPT-OSS's
    transposed, interleaved or MXFP4-packed experts): its full shape, and a reader of its full value."""

    shape: tuple[int, ...]
    read: Callable[[], torch.Tensor]


class StateDictAdapter(Protocol):
    """A family's names and layouts in Hugging Face releases. Reading is ``checkpoint/formats.py``'s alone,
    tensor by tensor, from these answers: no whole-dict conversion into our names exists to drift from it."""

    # ``quantization_config`` methods whose tensors ``hf_conversion`` dequantizes (GPT-OSS: mxfp4)
    quant_methods: frozenset[str]

    def to_hf(self, state: dict[str, torch.Tensor], args: DecoderConfig) -> dict[str, torch.Tensor]:
        """Our full state dict -> Hugging Face names and layout."""
        ...

    def hf_name(self, fqn: str, tied: bool) -> str:
        """The Hugging Face tensor that holds our parameter ``fqn`` (``tied``: the release ties embeddings)."""
        ...

    def hf_expert_names(self, fqn: str, args: DecoderConfig) -> list[str] | None:
        """The per-expert Hugging Face tensors of our stacked ``fqn`` ([E, ...]), in order (None: not stacked)."""
        ...

    def hf_permuted_heads(self, fqn: str, args: DecoderConfig) -> int | None:
        """Heads whose rows Hugging Face stores in another order in ``fqn`` (None: stored alike)."""
        ...

    def rows_from_hf(self, fqn: str, w: torch.Tensor, heads: int) -> torch.Tensor:
        """Whole heads' rows of ``fqn`` from Hugging Face's order into ours."""
        ...

    def hf_conversion(self, fqn: str, args: DecoderConfig, shapes: Mapping[str, tuple[int, ...]],
                      read: Callable[[str], torch.Tensor]) -> HFConversion | None:
        """How our ``fqn`` is made from the release's tensors (``shapes`` by name; ``read`` one whole) when
        renaming, stacking and ``rows_from_hf`` do not say it; None: they do."""
        ...

    def hf_config(self, args: DecoderConfig, *, bos_id: int | None, eos_id: int | None,
                  dtype: torch.dtype) -> JsonObject:
        """A ``config.json`` describing ``args``."""
        ...

    def hf_config_problems(self, args: DecoderConfig, config: JsonObject, source: str) -> list[str]:
        """One line per shape in which a ``config.json`` differs from ``args``."""
        ...


class MetaRelease(Protocol):
    """Meta's ``params.json`` and ``consolidated.*.pth`` (Llama 3's own reader)."""

    def params_problems(self, args: DecoderConfig, params: JsonObject, source: str) -> list[str]:
        """One line per shape in which ``params.json`` differs from ``args``."""
        ...

    def split_dim(self, fqn: str) -> int | None:
        """The dim along which Meta's model-parallel shards split ``fqn`` (None: replicated)."""
        ...

    def name(self, fqn: str, args: DecoderConfig, present: Container[str]) -> str:
        """The tensor of a release that holds our ``fqn`` (``present``: the names the release has)."""
        ...

    def shapes(self, shapes: dict[str, tuple[int, ...]], expected: Container[str],
               args: DecoderConfig) -> dict[str, tuple[int, ...]]:
        """A release's parameter shapes under our names, for comparison with ``expected``."""
        ...


DEFAULT_LOAD_BALANCE_COEFF = 1e-3  # DeepSeek-V3's bias update speed (its report's gamma)


@dataclass(frozen=True)
class ExpertSpec:
    """What a family with experts adds (``ModelSpec.experts``)."""

    # the job's [moe] section applied to the args
    with_moe_options: Callable[[DecoderConfig, JobConfig], DecoderConfig]
    # expert parallelism: shard each MoE layer's experts over the ``ep`` mesh, returning the expert
    # modules (FSDP shards each over ``efsdp``)
    apply_ep: Callable[[nn.Module, DeviceMesh], list[nn.Module]]
    # expert parallelism borrowing TP's ranks: each TP rank routes its own tokens through the MoE layers
    # (called with the ``tp`` mesh before ``apply_tp``)
    split_over_tp: Callable[[nn.Module, DeviceMesh], None]
    # the MoE layers of a model part, which the trainer balances and logs (train_step/experts.py)
    layers: Callable[[nn.Module], list[ExpertLayer]]
    # the planner's dry run (planning/moe.py): (model part, imbalance factor) -> the MoE layers made to
    # assume their token counts, which fake tensors do not hold
    assume_routing: Callable[[nn.Module, float], int]


@dataclass(frozen=True)
class ModelSpec:
    """Everything the rest of the code asks of one model family (see the module docstring)."""

    name: str  # --model.name
    args_type: type  # the family's DecoderConfig dataclass
    # ---- sizes: named flavors, and a release's config.json / params.json read into args
    flavors: Mapping[str, DecoderConfig]
    read_release: Callable[[str], DecoderConfig]  # ValueError (one line) for what the family cannot represent
    # ---- build: the model from args, on the current default device (the meta device in the trainer);
    # its param_init_specs() are the layout-invariant init
    build: Callable[[DecoderConfig], nn.Module]
    flops_per_token: Callable[[DecoderConfig, int], float]  # (args, seq_len) -> training FLOPs per token
    # ---- parallelize (distributed/parallelize.py applies these, then AC, compile and FSDP)
    apply_tp: Callable[[nn.Module, DeviceMesh, bool, bool], None]  # (model, tp_mesh, sequence_parallel, loss_parallel)
    # (model, --model.attention_backend, device type, cp mesh or None, seq_len): the run's attention backend
    use_attention: Callable[[nn.Module, str, str, DeviceMesh | None, int], None]
    # ---- pipeline: (stage, layers it keeps, is first, is last), pruning a copy of the whole model in
    # place; and the width of the hidden state that flows between stages [micro-batch, seq, width]
    prune_stage: Callable[[nn.Module, range, bool, bool], None]
    hidden_width: Callable[[DecoderConfig], int]
    # ---- preflight: the problems the family adds (heads and widths against TP, the attention backend), one each
    check: Callable[[DecoderConfig, ParallelDims, JobConfig], list[str]]
    # ---- weights in Hugging Face releases, and Meta's (None: the family has none)
    state_dict_adapter: StateDictAdapter
    meta_release: MetaRelease | None = None
    # ---- generation (torchtitan/generation): the model's forward takes ``cache=`` a
    # ``models/kv_cache.KVCache`` (new tokens only, positions and mask from the cache)
    supports_kv_cache: bool = False
    # ---- experts (None: a dense family)
    experts: ExpertSpec | None = None
    # whether the family's Hugging Face format has a place for the auxiliary-loss-free routing bias
    # (DeepSeek-V3's e_score_correction_bias): the bias is then its default balancing, else off by default
    # and an export of a model trained with it is refused (checkpoint/formats.export_hf)
    release_holds_routing_bias: bool = False

    def default_load_balance_coeff(self) -> float:
        """``--moe.load_balance_coeff`` when unset: the bias only where the release format can hold it."""
        return DEFAULT_LOAD_BALANCE_COEFF if self.release_holds_routing_bias else 0.0

    def num_experts(self, args: DecoderConfig) -> int:
        """Experts per sparse layer of ``args``'s model (0: dense)."""
        return args.num_experts

    def with_moe_options(self, args: DecoderConfig, cfg: JobConfig) -> DecoderConfig:
        return args if self.experts is None else self.experts.with_moe_options(args, cfg)

    @property
    def apply_ep(self) -> Callable[[nn.Module, DeviceMesh], list[nn.Module]] | None:
        return None if self.experts is None else self.experts.apply_ep

    @property
    def split_moe_over_tp(self) -> Callable[[nn.Module, DeviceMesh], None] | None:
        return None if self.experts is None else self.experts.split_over_tp

    def expert_layers(self, module: nn.Module) -> list[ExpertLayer]:
        return [] if self.experts is None else self.experts.layers(module)

    def assume_routing(self, module: nn.Module, imbalance: float) -> int:
        return 0 if self.experts is None else self.experts.assume_routing(module, imbalance)
