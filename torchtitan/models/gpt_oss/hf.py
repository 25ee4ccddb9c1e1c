"""GPT-OSS in Hugging Face folders: its ``config.json`` both ways, and its weights' names and layouts.

Pure functions, no file I/O (that is ``torchtitan/checkpoint/formats.py``). What differs from the
shared decoder's rows (``models/common/hf.py``), each a row of its map (``common/weight_map.py``):

- q/k/v/o have biases, each layer has ``self_attn.sinks`` [H] and the router ``mlp.router.bias`` [E];
  q/k rows (and their biases) are permuted within each head as for every rotary family;
- the experts are stacked there too, in another layout: ``gate_up_proj`` [E, D, 2F] (the
  transpose of ours) with gate and up *interleaved* (columns ``0::2`` gate, ``1::2`` up),
  ``gate_up_proj_bias`` [E, 2F] interleaved alike, ``down_proj`` [E, F, D] (transposed) and
  ``down_proj_bias`` [E, D] (rows with ``transpose`` and ``part``);
- a release holds the expert weights in MXFP4 (``gate_up_proj_blocks`` / ``_scales`` [E, 2F, ...] and
  ``down_proj_blocks`` / ``_scales`` [E, D, ...]: rows are out-features, as ours), dequantized on load
  (``mxfp4.py``, the rows' ``packed``). Another ``quantization_config`` is refused.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from torchtitan.models.common.config import JsonObject
from torchtitan.models.common.hf import DecoderHFAdapter
from torchtitan.models.common.hf_config import ConfigField, ConfigTable, shape_rows
from torchtitan.models.common.weight_map import Part, Permute, WeightMap, WeightTemplate
from torchtitan.models.gpt_oss.args import GptOssArgs, alternating_layer_types
from torchtitan.models.gpt_oss.mxfp4 import MXFP4
from torchtitan.models.layers import YarnScaling

ARCHITECTURE, MODEL_TYPE = "GptOssForCausalLM", "gpt_oss"
QUANT_METHODS = ("mxfp4",)


def _templates() -> list[WeightTemplate]:
    """GPT-OSS's rows of the declarative map (``models/common/weight_map.py``)."""
    layer = "model.layers.{layer}."
    rows = [
        WeightTemplate("tok_embeddings.weight", "model.embed_tokens.weight"),
        WeightTemplate("norm.weight", "model.norm.weight"),
        WeightTemplate("output.weight", "lm_head.weight"),
        WeightTemplate("layers.{layer}.attention_norm.weight", layer + "input_layernorm.weight"),
        WeightTemplate("layers.{layer}.ffn_norm.weight", layer + "post_attention_layernorm.weight"),
        WeightTemplate("layers.{layer}.attention.sinks", layer + "self_attn.sinks"),
        WeightTemplate("layers.{layer}.feed_forward.router.gate.weight", layer + "mlp.router.weight"),
        WeightTemplate("layers.{layer}.feed_forward.router.gate.bias", layer + "mlp.router.bias"),
    ]
    permute: dict[str, Permute | None] = {"wq": "query", "wk": "key", "wv": None, "wo": None}
    for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
        for kind in ("weight", "bias"):
            rows.append(WeightTemplate(f"layers.{{layer}}.attention.{ours}.{kind}",
                                       layer + f"self_attn.{theirs}.{kind}", permute=permute[ours]))
    # the experts: [E, in, out] there (or MXFP4 [E, out, ...]), gate and up rows alternating in gate_up_proj
    ours, experts, swap = "layers.{layer}.feed_forward.experts.", layer + "mlp.experts.", (1, 2)
    gate, up = Part(dim=1, index=0, count=2), Part(dim=1, index=1, count=2)
    rows += [WeightTemplate(ours + "w1", experts + "gate_up_proj", transpose=swap, part=gate, packed=MXFP4),
             WeightTemplate(ours + "w3", experts + "gate_up_proj", transpose=swap, part=up, packed=MXFP4),
             WeightTemplate(ours + "w2", experts + "down_proj", transpose=swap, packed=MXFP4),
             WeightTemplate(ours + "w1_bias", experts + "gate_up_proj_bias", part=gate),
             WeightTemplate(ours + "w3_bias", experts + "gate_up_proj_bias", part=up),
             WeightTemplate(ours + "w2_bias", experts + "down_proj_bias")]
    return rows


# ---------------------------------------------------------------- config.json


def _refuse(config: JsonObject) -> None:
    """ValueError (one line) for a ``quantization_config`` whose weights this reader cannot dequantize, or
    attention without biases."""
    quant = config.get("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    if quant is not None and method not in QUANT_METHODS:
        raise ValueError(f"quantization_config quant_method={method!r} is not supported; GPT-OSS releases "
                         f"load unquantized or as {', '.join(QUANT_METHODS)} (dequantized on load)")
    if config.get("attention_bias", True) is not True:
        raise ValueError("attention_bias=false: GPT-OSS's attention has biases; this reader expects them")


def _yarn(config: JsonObject) -> YarnScaling | None:
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind != "yarn":
        raise ValueError(f"rope type {kind!r} is not supported for GPT-OSS (yarn or default)")
    return YarnScaling.from_hf(params, int(config.get("max_position_embeddings", 131072)))


def _theta(config: JsonObject) -> float:
    return float(config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta", 150000.0)))


def _layer_types(config: JsonObject) -> tuple[str, ...]:
    return alternating_layer_types(config["num_hidden_layers"])  # the releases' default


def _rope_entries(args: GptOssArgs) -> JsonObject:
    rope: JsonObject = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_yarn is not None:
        rope = {**args.rope_yarn.to_hf(), "rope_theta": args.rope_theta}
    return {"rope_parameters": rope}


def _rows() -> tuple[ConfigField, ...]:
    """``config.json`` <-> ``GptOssArgs`` (``common/hf_config.py``), in transformers 5's key layout: the experts
    are as wide as ``intermediate_size`` (which is also the args' dense width, unused: every layer is sparse)."""
    shape = {row.ours: row for row in shape_rows(norm_eps=1e-5)}
    return (*(shape[k] for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size")),
            dataclasses.replace(shape["ffn_hidden_size"], written=None, compared=False),
            ConfigField("moe_hidden_size", ("intermediate_size",)), ConfigField("num_experts", ("num_local_experts",)),
            ConfigField("top_k", ("num_experts_per_tok", "experts_per_token"), default=4), shape["norm_eps"],
            ConfigField("rope_theta", derive=_theta, kind=float, written=None), shape["tie_word_embeddings"],
            ConfigField("sliding_window", ("sliding_window",), default=128, kind=int, falsy_default=True),
            ConfigField("layer_types", ("layer_types",), kind=tuple, falsy_default=True, derive=_layer_types,
                        write_as=list),
            ConfigField("swiglu_limit", ("swiglu_limit",), default=7.0, kind=float),
            ConfigField("swiglu_alpha", ("swiglu_alpha",), default=1.702, kind=float),
            ConfigField("rope_yarn", derive=_yarn, written=None),
            ConfigField("max_seq_len", ("max_position_embeddings",), default=131072, kind=int, compared=False))


CONFIG = ConfigTable(GptOssArgs, (ARCHITECTURE,), (MODEL_TYPE,), _rows(), refuse=_refuse, more=_rope_entries,
                     constants={"attention_bias": True, "router_aux_loss_coef": 0.0, "output_router_logits": False})


def read_release(path: str | Path) -> GptOssArgs:
    """The args of the GPT-OSS release at ``path`` (folder or config.json); ValueError (one line) otherwise."""
    return CONFIG.read(path)


class GptOssHFAdapter(DecoderHFAdapter):
    """The decoder's adapter over GPT-OSS's map (its experts transposed, interleaved or MXFP4-packed: rows)."""

    quant_methods = frozenset(QUANT_METHODS)  # MXFP4 experts: the rows' packed format dequantizes them

    def __init__(self) -> None:
        super().__init__(WeightMap(_templates()), CONFIG)
