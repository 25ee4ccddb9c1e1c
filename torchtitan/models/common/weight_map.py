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
- ``transpose``: ours is theirs with these two dims swapped (GPT-OSS stores its experts [E, in, out]).
- ``part``: ours is one of ``count`` tensors interleaved along ``dim`` (in our orientation) in theirs;
  export gathers the parts into the one tensor (GPT-OSS's gate and up rows alternate in ``gate_up_proj``).
- ``packed``: theirs may be stored quantized instead, as a ``PackedFormat``'s pair of tensors beside its
  name, already in our orientation (GPT-OSS's MXFP4 experts, ``gpt_oss/mxfp4.py``); read dequantized.

``ExportCopy`` rows name a tensor the release stores once more per layer (DeepSeek-V3's MTP layer keeps
copies of the embedding and the output head): written on export, never read (ours is the one tensor).

``WeightMap`` answers every question the checkpoint formats (``checkpoint/formats.py``) ask about names
and layouts, from these rows alone; that module alone reads a release, tensor by tensor (an FP8 release's
block scales are multiplied in there, ``checkpoint/quantized.py``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal, cast

import torch

from torchtitan.models.attention.gqa import GQAConfig
from torchtitan.models.common.config import DecoderConfig
from torchtitan.models.spec import HFConversion

Permute = Literal["query", "key", "head"]


@dataclass(frozen=True)
class Part:
    """Ours is the slice ``index::count`` along ``dim`` of theirs: one of ``count`` interleaved tensors."""

    dim: int
    index: int
    count: int


@dataclass(frozen=True)
class PackedFormat:
    """A quantized storage: ``<name><suffixes[0]>`` [..., G, B] and ``<name><suffixes[1]>`` [..., G] hold
    ``G * values_per_group`` values per row, which ``dequantize`` (of the two) gives."""

    suffixes: tuple[str, str]
    values_per_group: int
    dequantize: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class WeightTemplate:
    """One kind of tensor: our name and Hugging Face's, with ``{layer}`` / ``{expert}`` (module docstring)."""

    ours: str
    theirs: str
    permute: Permute | None = None
    rotary_dims: int | None = None  # None: the whole head rotates
    transpose: tuple[int, int] | None = None
    part: Part | None = None
    packed: PackedFormat | None = None

    @property
    def stacked(self) -> bool:
        return "{expert}" in self.theirs and "{expert}" not in self.ours

    @property
    def converted(self) -> bool:
        """Made from theirs by more than renaming, stacking and permuting rows."""
        return self.transpose is not None or self.part is not None or self.packed is not None

    def layout_from_hf(self, w: torch.Tensor, *, transposed: bool) -> torch.Tensor:
        """Theirs (``transposed``: stored with ``transpose``'s dims swapped; a packed tensor is not) -> ours."""
        if transposed and self.transpose is not None:
            w = w.transpose(*self.transpose)
        if self.part is not None:
            dim = self.part.dim % w.dim()
            w = w[(slice(None),) * dim + (slice(self.part.index, None, self.part.count),)]
        return w.contiguous()

    def layout_to_hf(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Ours (every part of the tensor, in order) -> theirs, unquantized."""
        w = parts[0]
        if self.part is not None:  # [..., n, ...] each -> [..., n * count, ...], the parts alternating
            dim = self.part.dim % w.dim()
            w = torch.stack(parts, dim=dim + 1).flatten(dim, dim + 1)
        return w if self.transpose is None else w.transpose(*self.transpose).contiguous()

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


@dataclass(frozen=True)
class ExportCopy:
    """Our ``ours`` written again as ``theirs`` for each ``{layer}`` whose parameters start with ``per``."""

    ours: str
    theirs: str
    per: str

    def layers(self, fqns: Iterable[str]) -> set[str]:
        pattern = re.compile("^" + re.escape(self.per).replace(r"\{layer\}", r"(?P<layer>\d+)"))
        return {m.group("layer") for fqn in fqns if (m := pattern.match(fqn))}


_EMBEDDING = "tok_embeddings.weight"
_OUTPUT = "output.weight"


class WeightMap:
    """Our names <-> a release's, from ``WeightTemplate`` rows. A tied output is the embedding's tensor there."""

    def __init__(self, templates: Iterable[WeightTemplate], copies: Iterable[ExportCopy] = ()):
        self.templates, self.copies = tuple(templates), tuple(copies)

    def _row(self, fqn: str) -> tuple[WeightTemplate, dict[str, str]] | None:
        for t in self.templates:
            found = t.match_ours(fqn)
            if found is not None:
                return t, found
        return None

    def _find(self, fqn: str) -> tuple[WeightTemplate, dict[str, str]]:
        row = self._row(fqn)
        if row is None:
            raise KeyError(f"no Hugging Face name for parameter {fqn!r}")
        return row

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

    def hf_conversion(self, fqn: str, shapes: Mapping[str, tuple[int, ...]],
                      read: Callable[[str], torch.Tensor]) -> HFConversion | None:
        """Our ``fqn`` made from the release's tensors (``shapes`` by name, ``read`` one whole) when its row
        transposes, takes a part or may be packed; None: renamed, stacked or permuted. ValueError (one line)
        when the release holds it in neither form."""
        row = self._row(fqn)
        if row is None or not row[0].converted:
            return None
        t, found = row
        name = t.theirs.format(layer=found.get("layer", ""), expert=0)
        packed = t.packed
        if name in shapes:
            def value() -> torch.Tensor:
                return t.layout_from_hf(read(name), transposed=True)
            stored = shapes[name]
        elif packed is not None and all(name + s in shapes for s in packed.suffixes):
            def value() -> torch.Tensor:
                return t.layout_from_hf(packed.dequantize(*(read(name + s) for s in packed.suffixes)),
                                        transposed=False)
            *rows, groups, _ = shapes[name + packed.suffixes[0]]
            stored = (*rows, groups * packed.values_per_group)
        else:
            raise ValueError(f"the Hugging Face weights lack {name} (for our {fqn}); the folder is incomplete or "
                             "of another shape")
        meta = torch.empty(stored, device="meta")  # the shape, by the same layout change as the value's
        shape = t.layout_from_hf(meta, transposed=name in shapes).shape
        return HFConversion(tuple(shape), value)

    def to_hf(self, state: dict[str, torch.Tensor], args: DecoderConfig) -> dict[str, torch.Tensor]:
        """Ours -> the release's: experts unstacked, rotary rows permuted, parts gathered, copies written;
        tied: no output tensor. A routing bias is written where a row names it (DeepSeek-V3's); the other
        families' releases have no place for one."""
        out: dict[str, torch.Tensor] = {}
        parts: dict[str, tuple[WeightTemplate, dict[int, torch.Tensor]]] = {}
        for fqn, w in state.items():
            if fqn == _OUTPUT and args.tie_word_embeddings:
                continue  # a tied output has no tensor of its own
            if fqn.endswith("router.expert_bias") and self._row(fqn) is None:
                continue
            t, found = self._find(fqn)
            name = t.theirs.format(layer=found.get("layer", ""), expert=0)
            experts, heads = self.hf_expert_names(fqn, args), self.hf_permuted_heads(fqn, args)
            if t.part is not None:
                parts.setdefault(name, (t, {}))[1][t.part.index] = w
            elif experts is not None:
                out.update({n: w[e] for e, n in enumerate(experts)})
            elif heads is not None:
                out[name] = permute_rows(w, heads, to_hf=True, rotary_dims=t.rotary_dims).contiguous()
            else:
                out[name] = t.layout_to_hf([w])
        for name, (t, pieces) in parts.items():
            assert t.part is not None and len(pieces) == t.part.count, f"{name}: a part of ours is not in the state"
            out[name] = t.layout_to_hf([pieces[i] for i in range(t.part.count)])
        for copy in self.copies:
            # safetensors stores no tensor twice: each copy is a tensor of its own
            out.update({copy.theirs.format(layer=layer): state[copy.ours].clone()
                        for layer in sorted(copy.layers(state)) if copy.ours in state})
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
