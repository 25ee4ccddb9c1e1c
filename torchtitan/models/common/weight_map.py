"""Declarative weight maps between our parameter names and a Hugging Face release's.

A family states its map as a list of ``WeightTemplate`` rows, one per kind of tensor:

    WeightTemplate("layers.{layer}.attention.wq.weight", "model.layers.{layer}.self_attn.q_proj.weight",
                   permute="query")
    WeightTemplate("layers.{layer}.feed_forward.experts.w1",
                   "model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight")

- ``{layer}`` and ``{expert}`` are filled from our name and the model's expert count; a template whose
  Hugging Face side names ``{expert}`` (and ours does not) is *stacked*: our ``[E, ...]`` tensor is the
  per-expert tensors stacked along dim 0.
- ``permute``: the rows of each head whose rotary layout differs. We rotate adjacent pairs
  (x[2i], x[2i+1]); Hugging Face rotates the two halves (x[i], x[i + d/2]) and stores the rows permuted
  to match: within every head, row ``c * d/2 + i`` of theirs is row ``2i + c`` of ours. ``query`` and
  ``key`` permute ``n_heads`` and ``n_kv_heads`` heads of a projection; ``head`` the entries of one
  head's vector (a query/key norm's weight).
- ``rotary_dims``: only that many trailing rows of each head rotate (partial rotary, as MLA's
  ``qk_rope_head_dim`` beside its ``qk_nope_head_dim``); the rows before them are stored alike.

``WeightMap`` answers every question the checkpoint formats (``checkpoint/formats.py``) ask about names
and layouts, from these rows alone; that module alone reads a release, tensor by tensor (an FP8 release's
block scales are multiplied in there, ``checkpoint/quantized.py``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, cast

import torch

from torchtitan.models.attention.gqa import GQAConfig
from torchtitan.models.common.config import DecoderConfig

Permute = Literal["query", "key", "head"]


@dataclass(frozen=True)
class WeightTemplate:
    """One kind of tensor: our name and Hugging Face's, with ``{layer}`` / ``{expert}`` (module docstring)."""

    ours: str
    theirs: str
    permute: Permute | None = None
    rotary_dims: int | None = None  # None: the whole head rotates

    @property
    def stacked(self) -> bool:
        return "{expert}" in self.theirs and "{expert}" not in self.ours

    def _pattern(self, template: str) -> re.Pattern[str]:
        escaped = re.escape(template).replace(r"\{layer\}", r"(?P<layer>\d+)")
        escaped = escaped.replace(r"\{expert\}", r"(?P<expert>\d+)")
        return re.compile(f"^{escaped}$")

    def match_ours(self, fqn: str) -> dict[str, str] | None:
        m = self._pattern(self.ours).match(fqn)
        return m.groupdict() if m else None


def permute_rows(w: torch.Tensor, heads: int, *, to_hf: bool, rotary_dims: int | None = None) -> torch.Tensor:
    """Each head's rotary rows from adjacent pairs (ours) to halves (Hugging Face's), or back (``to_hf`` False).

    ``w``: [heads * head_dim, ...] or a 1-D per-head vector; ``rotary_dims``: the trailing rows of each head
    that rotate (None: all of them).
    """
    if w.dim() == 1:
        return permute_rows(w[:, None], heads, to_hf=to_hf, rotary_dims=rotary_dims)[:, 0]
    rows, rest = w.shape[0], w.shape[1:]
    hd = rows // heads
    r = hd if rotary_dims is None else rotary_dims
    per_head = w.reshape(heads, hd, *rest)
    plain, rot = per_head[:, : hd - r], per_head[:, hd - r :]
    split = (r // 2, 2) if to_hf else (2, r // 2)
    rot = rot.reshape(heads, *split, *rest).transpose(1, 2).reshape(heads, r, *rest)
    out = rot if r == hd else torch.cat([plain, rot], dim=1)
    return out.reshape(rows, *rest)


_EMBEDDING = "tok_embeddings.weight"
_OUTPUT = "output.weight"


class WeightMap:
    """Our names <-> a release's, from ``WeightTemplate`` rows. A tied output is the embedding's tensor there."""

    def __init__(self, templates: Iterable[WeightTemplate]):
        self.templates = tuple(templates)

    def _find(self, fqn: str) -> tuple[WeightTemplate, dict[str, str]]:
        for t in self.templates:
            found = t.match_ours(fqn)
            if found is not None:
                return t, found
        raise KeyError(f"no Hugging Face name for parameter {fqn!r}")

    def hf_name(self, fqn: str, tied: bool) -> str:
        """The release's tensor holding our ``fqn`` (stacked experts: the first expert's); tied: the embedding's."""
        if fqn == _OUTPUT and tied:
            fqn = _EMBEDDING  # as transformers reads it: an lm_head.weight beside it is ignored there too
        t, found = self._find(fqn)
        return t.theirs.format(layer=found.get("layer", ""), expert=0)

    def hf_expert_names(self, fqn: str, args: DecoderConfig) -> list[str] | None:
        """The per-expert tensors our stacked ``fqn`` holds, in expert order (None: not stacked)."""
        t, found = self._find(fqn)
        if not t.stacked:
            return None
        return [t.theirs.format(layer=found.get("layer", ""), expert=e) for e in range(args.num_experts)]

    def hf_permuted_heads(self, fqn: str, args: DecoderConfig) -> int | None:
        """How many heads' rows the release orders otherwise in ``fqn`` (None: stored alike)."""
        t, _ = self._find(fqn)
        if t.permute is None:
            return None
        attn = cast(GQAConfig, args.attention())  # only grouped-query attention's rows are permuted (query, key)
        return {"query": attn.n_heads, "key": attn.n_kv_heads, "head": 1}[t.permute]

    def rotary_dims(self, fqn: str) -> int | None:
        return self._find(fqn)[0].rotary_dims

    def rows_from_hf(self, w: torch.Tensor, heads: int, rotary_dims: int | None = None) -> torch.Tensor:
        return permute_rows(w, heads, to_hf=False, rotary_dims=rotary_dims)

    def to_hf(self, state: dict[str, torch.Tensor], args: DecoderConfig) -> dict[str, torch.Tensor]:
        """Ours -> the release's: experts unstacked, rotary rows permuted; tied: no output tensor."""
        out: dict[str, torch.Tensor] = {}
        for fqn, t in state.items():
            if fqn == _OUTPUT and args.tie_word_embeddings or fqn.endswith("router.expert_bias"):
                continue  # a tied output has no tensor of its own; Hugging Face's models have no routing bias
            names = self.hf_expert_names(fqn, args)
            if names is not None:
                out.update({name: t[e] for e, name in enumerate(names)})
                continue
            heads = self.hf_permuted_heads(fqn, args)
            rows = permute_rows(t, heads, to_hf=True, rotary_dims=self.rotary_dims(fqn)).contiguous() if heads else t
            out[self.hf_name(fqn, tied=False)] = rows
        return out


QWEN_EXPERT_NAMES = ("gate_proj", "down_proj", "up_proj")


def decoder_templates(moe_module: str = "mlp",
                      expert_names: tuple[str, str, str] = QWEN_EXPERT_NAMES) -> list[WeightTemplate]:
    """The rows of the shared decoder in Hugging Face's Llama-style layout (Llama 3, Qwen3, Mixtral).

    ``moe_module``: the sparse feed-forward's module (its router is ``{moe_module}.gate``); ``expert_names``:
    each expert's w1, w2, w3 there.
    """
    layer = "model.layers.{layer}."
    rows = [
        WeightTemplate("tok_embeddings.weight", "model.embed_tokens.weight"),
        WeightTemplate("norm.weight", "model.norm.weight"),
        WeightTemplate("output.weight", "lm_head.weight"),
        WeightTemplate("layers.{layer}.attention.wq.weight", layer + "self_attn.q_proj.weight", permute="query"),
        WeightTemplate("layers.{layer}.attention.wk.weight", layer + "self_attn.k_proj.weight", permute="key"),
        WeightTemplate("layers.{layer}.attention.wv.weight", layer + "self_attn.v_proj.weight"),
        WeightTemplate("layers.{layer}.attention.wo.weight", layer + "self_attn.o_proj.weight"),
        WeightTemplate("layers.{layer}.attention.q_norm.weight", layer + "self_attn.q_norm.weight", permute="head"),
        WeightTemplate("layers.{layer}.attention.k_norm.weight", layer + "self_attn.k_norm.weight", permute="head"),
        WeightTemplate("layers.{layer}.attention_norm.weight", layer + "input_layernorm.weight"),
        WeightTemplate("layers.{layer}.ffn_norm.weight", layer + "post_attention_layernorm.weight"),
        WeightTemplate("layers.{layer}.feed_forward.w1.weight", layer + "mlp.gate_proj.weight"),
        WeightTemplate("layers.{layer}.feed_forward.w2.weight", layer + "mlp.down_proj.weight"),
        WeightTemplate("layers.{layer}.feed_forward.w3.weight", layer + "mlp.up_proj.weight"),
        WeightTemplate("layers.{layer}.feed_forward.router.gate.weight", layer + moe_module + ".gate.weight"),
    ]
    for ours, theirs in zip(("w1", "w2", "w3"), expert_names):
        rows.append(WeightTemplate(f"layers.{{layer}}.feed_forward.experts.{ours}",
                                   layer + moe_module + ".experts.{expert}." + theirs + ".weight"))
    return rows
