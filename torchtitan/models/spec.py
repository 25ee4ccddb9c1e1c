"""What the rest of the code asks of a model family: one ``ModelSpec`` per family.

The trainer, preflight, evaluation, the planner and the checkpoint formats never import a family;
they look its spec up by ``model.name`` (``torchtitan/models/registry.py``) and go through it. A
family lives in ``torchtitan/models/<family>/`` and registers its spec there (docs/models.md says
how to add one).

Besides the spec's functions, the generic code relies on a few names of the family's model and
arguments (``FamilyModel``, ``FamilyArgs``): the repeated blocks in ``model.layers`` (what
pipeline stages split and activation checkpointing, compile and FSDP wrap), the layout-invariant
init specs, and the shape fields that preflight fills from the config.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.config import JobConfig
from torchtitan.distributed.init_spec import InitSpec
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.expert_balance import ExpertLayer


class FamilyArgs(Protocol):
    """A family's hyper-parameters: a dataclass; preflight replaces these fields from the config."""

    vocab_size: int  # a named flavor takes the tokenizer's
    max_seq_len: int  # the training sequence length
    attn_mask_type: str  # --model.attn_mask_type
    n_layers: int  # the blocks that pipeline stages split


class FamilyModel(Protocol):
    """What the generic code calls on a family's model (the whole model, or one pipeline stage of it)."""

    args: Any
    layers: nn.ModuleDict  # the repeated blocks, keyed by their index in the whole model

    def param_init_specs(self) -> dict[str, InitSpec]:
        """FQN -> how to initialize it: the layout-invariant init (distributed/layout_init.py) reads it."""
        ...

    def init_weights(self, buffer_device: torch.device | None = None) -> None: ...

    def init_buffers(self, buffer_device: torch.device | None = None) -> None: ...

    def num_params(self, exclude_embedding: bool = False) -> int: ...

    # Generation (a spec with ``supports_kv_cache``): ``forward(tokens, cache=KVCache)`` takes the
    # rows' new tokens, appends their keys and values to the cache and returns their logits; the
    # args' ``max_seq_len`` is the longest sequence it takes.


@dataclass(frozen=True)
class HFConversion:
    """One of our parameters made from a release's tensors by more than renaming and stacking (GPT-OSS's
    transposed, interleaved or MXFP4-packed experts): its full shape, and a reader of its full value."""

    shape: tuple[int, ...]
    read: Callable[[], torch.Tensor]


class StateDictAdapter(Protocol):
    """A family's names and layouts in Hugging Face and Meta releases (checkpoint/formats.py does the I/O)."""

    def to_hf(self, state: dict[str, torch.Tensor], args: Any) -> dict[str, torch.Tensor]:
        """Our full state dict -> Hugging Face names and layout."""
        ...

    def from_hf(self, state: dict[str, torch.Tensor], args: Any) -> dict[str, torch.Tensor]:
        """Hugging Face names and layout -> ours."""
        ...

    def hf_name(self, fqn: str, tied: bool) -> str:
        """The Hugging Face tensor that holds our parameter ``fqn`` (``tied``: the release ties embeddings)."""
        ...

    def hf_expert_names(self, fqn: str, args: Any) -> list[str] | None:
        """The per-expert Hugging Face tensors of our stacked ``fqn`` ([E, ...]), in order (None: not stacked)."""
        ...

    def hf_permuted_heads(self, fqn: str, args: Any) -> int | None:
        """Heads whose rows Hugging Face stores in another order in ``fqn`` (None: stored alike)."""
        ...

    def rows_from_hf(self, w: torch.Tensor, heads: int) -> torch.Tensor:
        """Whole heads' rows from Hugging Face's order into ours."""
        ...

    def hf_conversion(self, fqn: str, args: Any, shapes: Mapping[str, tuple[int, ...]],
                      read: Callable[[str], torch.Tensor]) -> HFConversion | None:
        """How our ``fqn`` is made from the release's tensors (``shapes`` by name; ``read`` one whole) when
        renaming, stacking and ``rows_from_hf`` do not say it; None: they do."""
        ...

    def hf_config(self, args: Any, *, bos_id: int | None, eos_id: int | None, dtype: torch.dtype) -> dict[str, Any]:
        """A ``config.json`` describing ``args``."""
        ...

    def hf_config_problems(self, args: Any, config: dict[str, Any], source: str) -> list[str]:
        """One line per shape in which a ``config.json`` differs from ``args``."""
        ...

    def meta_params_problems(self, args: Any, params: dict[str, Any], source: str) -> list[str]:
        """One line per shape in which Meta's ``params.json`` differs from ``args``."""
        ...

    def meta_split_dim(self, fqn: str) -> int | None:
        """The dim along which Meta's model-parallel shards split ``fqn`` (None: replicated)."""
        ...

    def meta_name(self, fqn: str, args: Any, present: Container[str]) -> str:
        """The tensor of a Meta release that holds our ``fqn`` (``present``: the names the release has)."""
        ...

    def meta_shapes(self, shapes: dict[str, tuple[int, ...]], expected: Container[str],
                    args: Any) -> dict[str, tuple[int, ...]]:
        """A Meta release's parameter shapes under our names, for comparison with ``expected``."""
        ...


DEFAULT_LOAD_BALANCE_COEFF = 1e-3  # DeepSeek-V3's bias update speed (its report's gamma)


def _no_experts(args: Any) -> int:
    return 0


def _unchanged(args: Any, cfg: JobConfig) -> Any:
    return args


def _no_expert_layers(module: nn.Module) -> list[ExpertLayer]:
    return []


def _no_routing(module: nn.Module, imbalance: float) -> int:
    return 0


@dataclass(frozen=True)
class ModelSpec:
    """Everything the rest of the code asks of one model family (see the module docstring)."""

    name: str  # --model.name
    args_type: type  # the family's FamilyArgs dataclass
    # ---- sizes: named flavors, and a release's config.json / params.json read into args
    flavors: Mapping[str, Any]
    read_release: Callable[[str], Any]  # ValueError (one line) for what the family cannot represent
    # ---- build: the model from args, on the current default device (the meta device in the trainer);
    # its param_init_specs() are the layout-invariant init
    build: Callable[[Any], nn.Module]
    flops_per_token: Callable[[Any, int], float]  # (args, seq_len) -> training FLOPs per token
    # ---- parallelize (distributed/parallelize.py applies these, then AC, compile and FSDP)
    use_cpu_kernels: Callable[[nn.Module, bool], dict[str, int]]  # (model, onednn_linears) -> counts
    apply_tp: Callable[..., None]  # (model, tp_mesh, sequence_parallel=, loss_parallel=): the TP plan
    apply_cp: Callable[[nn.Module, DeviceMesh, int], None]  # (model, cp_mesh, seq_len): the CP binding
    # ---- pipeline: (stage, layers it keeps, is first, is last), pruning a copy of the whole model in
    # place; and the width of the hidden state that flows between stages [micro-batch, seq, width]
    prune_stage: Callable[[nn.Module, range, bool, bool], None]
    hidden_width: Callable[[Any], int]
    # ---- preflight: the problems the family adds (heads and widths against TP, ...), one line each
    check: Callable[[Any, ParallelDims, JobConfig], list[str]]
    # ---- weights in Hugging Face and Meta releases
    state_dict_adapter: StateDictAdapter
    # ---- generation (torchtitan/generation): the model's forward takes ``cache=`` a
    # ``models/kv_cache.KVCache`` (new tokens only, positions and mask from the cache)
    supports_kv_cache: bool = False
    # ---- experts (a dense family keeps the defaults): how many each sparse layer has (0: dense); the
    # job's [moe] section applied to the args; and expert parallelism: shard each MoE layer's experts
    # over the ``ep`` mesh, returning the expert modules (FSDP shards each over ``efsdp``)
    num_experts: Callable[[Any], int] = _no_experts
    with_moe_options: Callable[[Any, JobConfig], Any] = _unchanged
    apply_ep: Callable[[nn.Module, DeviceMesh], list[nn.Module]] | None = None
    # the MoE layers of a model part, which the trainer balances and logs (train_step/experts.py)
    expert_layers: Callable[[nn.Module], list[ExpertLayer]] = _no_expert_layers
    # the planner's dry run (planning/moe.py): (model part, imbalance factor) -> the MoE layers made to
    # assume their token counts, which fake tensors do not hold
    assume_routing: Callable[[nn.Module, float], int] = _no_routing
    # whether the family's Hugging Face format has a place for the auxiliary-loss-free routing bias
    # (DeepSeek-V3's e_score_correction_bias): the bias is then its default balancing, else off by default
    # and an export of a model trained with it is refused (checkpoint/formats.export_hf)
    release_holds_routing_bias: bool = False

    def default_load_balance_coeff(self) -> float:
        """``--moe.load_balance_coeff`` when unset: the bias only where the release format can hold it."""
        return DEFAULT_LOAD_BALANCE_COEFF if self.release_holds_routing_bias else 0.0
