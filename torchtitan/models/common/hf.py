"""A ``MoEDecoder``'s weights under Hugging Face names (Qwen3, Qwen3-MoE, Mixtral): the family's adapter.

Pure functions, no file I/O (that is ``torchtitan/checkpoint/formats.py``). Experts are stacked here
(``experts.w1 [E, F, D]``) and one tensor per expert there (``...experts.{e}.gate_proj.weight [F, D]``):
stacked on load, unstacked on export. The rotary layout differs as for Llama 3 (``models/llama3/convert.py``
says how): q/k rows are permuted within each head, and so is the query/key norm's weight, whose
entries follow those rows.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torchtitan.models.spec import HFConversion

_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_ATTN = {"attention.wq.weight": "self_attn.q_proj.weight", "attention.wk.weight": "self_attn.k_proj.weight",
         "attention.wv.weight": "self_attn.v_proj.weight", "attention.wo.weight": "self_attn.o_proj.weight",
         "attention.q_norm.weight": "self_attn.q_norm.weight", "attention.k_norm.weight": "self_attn.k_norm.weight",
         "attention_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
         "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w2.weight": "mlp.down_proj.weight",
         "feed_forward.w3.weight": "mlp.up_proj.weight"}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_EXPERTS = ("w1", "w2", "w3")


def permute_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of each head from adjacent pairs (ours) to halves (Hugging Face's); 1-D: one head's entries."""
    if w.dim() == 1:
        return permute_to_hf(w[:, None], n_heads)[:, 0]
    rows, cols = w.shape
    hd = rows // n_heads
    return w.reshape(n_heads, hd // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def permute_from_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of ``permute_to_hf``."""
    if w.dim() == 1:
        return permute_from_hf(w[:, None], n_heads)[:, 0]
    rows, cols = w.shape
    hd = rows // n_heads
    return w.reshape(n_heads, 2, hd // 2, cols).transpose(1, 2).reshape(rows, cols)


@dataclass(frozen=True)
class HFNaming:
    """How a family names its sparse feed-forward: Qwen3-MoE ``mlp`` + gate/down/up_proj, Mixtral
    ``block_sparse_moe`` + w1/w2/w3."""

    moe: str  # the sparse feed-forward's module: its router is ``{moe}.gate``
    expert: dict[str, str]  # our stacked w1/w2/w3 -> the per-expert linear's name


QWEN3_NAMING = HFNaming("mlp", {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"})
MIXTRAL_NAMING = HFNaming("block_sparse_moe", {"w1": "w1", "w2": "w2", "w3": "w3"})


class DecoderHFAdapter:
    """The ``StateDictAdapter`` (models/spec.py) of a ``MoEDecoder`` family; Hugging Face releases only.

    ``hf_config`` / ``config_fields`` are the family's (its ``config.json`` layout); ``model_fields``
    says what of ``args`` a release must agree on.
    """

    def __init__(self, naming: HFNaming, hf_config: Callable[..., dict[str, Any]],
                 fields_of_config: Callable[[dict[str, Any]], dict[str, Any]],
                 fields_of_args: Callable[[Any], dict[str, Any]]):
        self.naming = naming
        self._hf_config, self._fields_of_config, self._fields_of_args = hf_config, fields_of_config, fields_of_args

    # ---- names
    def hf_name(self, fqn: str, tied: bool) -> str:
        if fqn == "output.weight" and tied:
            return _TOP["tok_embeddings.weight"]
        if fqn in _TOP:
            return _TOP[fqn]
        m = _LAYER.match(fqn)
        if m:
            layer, rest = m.groups()
            if rest in _ATTN:
                return f"model.layers.{layer}.{_ATTN[rest]}"
            if rest == "feed_forward.router.gate.weight":
                return f"model.layers.{layer}.{self.naming.moe}.gate.weight"
            if rest.startswith("feed_forward.experts.") and rest.split(".")[-1] in _EXPERTS:
                # Stacked: the first expert's tensor names the shape; hf_expert_names lists them all.
                return self.expert_name(int(layer), 0, rest.split(".")[-1])
        raise KeyError(f"no Hugging Face name for parameter {fqn!r}")

    def expert_name(self, layer: int, e: int, w: str) -> str:
        return f"model.layers.{layer}.{self.naming.moe}.experts.{e}.{self.naming.expert[w]}.weight"

    def hf_expert_names(self, fqn: str, args: Any) -> list[str] | None:
        """The per-expert tensors that our stacked ``fqn`` holds, in expert order (None: not stacked)."""
        m = _LAYER.match(fqn)
        if not m or not m.group(2).startswith("feed_forward.experts."):
            return None
        w = m.group(2).split(".")[-1]
        return [self.expert_name(int(m.group(1)), e, w) for e in range(args.num_experts)]

    def hf_permuted_heads(self, fqn: str, args: Any) -> int | None:
        if fqn.endswith("attention.wq.weight"):
            return args.n_heads
        if fqn.endswith("attention.wk.weight"):
            return args.n_kv_heads
        if fqn.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
            return 1
        return None

    def hf_conversion(self, fqn: str, args: Any, shapes: Mapping[str, tuple[int, ...]],
                      read: Callable[[str], torch.Tensor]) -> HFConversion | None:
        return None  # every tensor is renamed, stacked or permuted by rows

    def rows_from_hf(self, w: torch.Tensor, heads: int) -> torch.Tensor:
        return permute_from_hf(w, heads)

    # ---- whole state dicts
    def to_hf(self, state: dict[str, torch.Tensor], args: Any) -> dict[str, torch.Tensor]:
        """Ours -> Hugging Face's: experts unstacked, q/k (and their norms) permuted; tied: no lm_head."""
        out: dict[str, torch.Tensor] = {}
        for fqn, t in state.items():
            if fqn == "output.weight" and args.tie_word_embeddings or fqn.endswith("router.expert_bias"):
                continue  # a tied output has no tensor of its own; Hugging Face's models have no routing bias
            names = self.hf_expert_names(fqn, args)
            if names is not None:
                out.update({name: t[e] for e, name in enumerate(names)})
                continue
            heads = self.hf_permuted_heads(fqn, args)
            out[self.hf_name(fqn, tied=False)] = permute_to_hf(t, heads).contiguous() if heads else t
        return out

    def from_hf(self, state: dict[str, torch.Tensor], args: Any) -> dict[str, torch.Tensor]:
        """Hugging Face's -> ours, for the parameters of ``args``'s model; ValueError naming a missing tensor."""
        from torchtitan.models.common.moe_decoder import MoEDecoder

        with torch.device("meta"):
            fqns = [fqn for fqn, _ in MoEDecoder(args).named_parameters(remove_duplicate=False)]
        out: dict[str, torch.Tensor] = {}
        for fqn in fqns:
            names = self.hf_expert_names(fqn, args) or [self.hf_name(fqn, tied=bool(args.tie_word_embeddings))]
            missing = [n for n in names if n not in state]
            if fqn == "output.weight" and missing and "model.embed_tokens.weight" in state:
                names, missing = ["model.embed_tokens.weight"], []  # no lm_head: tied
            if missing:
                raise ValueError(f"the Hugging Face weights lack {missing[0]} (for our {fqn}); the folder is "
                                 "incomplete or of another shape")
            if self.hf_expert_names(fqn, args) is not None:
                out[fqn] = torch.stack([state[n] for n in names])
                continue
            heads = self.hf_permuted_heads(fqn, args)
            out[fqn] = permute_from_hf(state[names[0]], heads).contiguous() if heads else state[names[0]]
        return out

    # ---- configs
    def hf_config(self, args: Any, *, bos_id: int | None, eos_id: int | None, dtype: torch.dtype) -> dict[str, Any]:
        return self._hf_config(args, bos_id=bos_id, eos_id=eos_id, dtype=dtype)

    def hf_config_problems(self, args: Any, config: dict[str, Any], source: str) -> list[str]:
        ours, theirs = self._fields_of_args(args), self._fields_of_config(config)
        return [f"{source}: {k} is {theirs.get(k)!r} there, {v!r} in the configured model"
                for k, v in ours.items() if theirs.get(k) != v]

    # ---- Meta's releases: none for these families
    def meta_params_problems(self, args: Any, params: dict[str, Any], source: str) -> list[str]:
        return [f"{source}: this model family has no Meta-format release; use --checkpoint.initial_load_format=hf"]

    def meta_split_dim(self, fqn: str) -> int | None:
        return None

    def meta_name(self, fqn: str, args: Any, present: Container[str]) -> str:
        return fqn

    def meta_shapes(self, shapes: dict[str, tuple[int, ...]], expected: Container[str],
                    args: Any) -> dict[str, tuple[int, ...]]:
        return shapes
