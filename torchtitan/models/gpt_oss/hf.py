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

from pathlib import Path

import torch

from torchtitan.models.common.config import DecoderConfig, JsonObject
from torchtitan.models.common.hf import DecoderHFAdapter
from torchtitan.models.common.hf_config import read_config
from torchtitan.models.common.weight_map import Part, Permute, WeightMap, WeightTemplate
from torchtitan.models.gpt_oss.args import GptOssArgs
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


def _gpt_oss(args: DecoderConfig) -> GptOssArgs:
    if not isinstance(args, GptOssArgs):
        raise TypeError(f"{type(args).__name__} is not GPT-OSS's arguments")
    return args


def check_quantization(config: JsonObject, source: str) -> None:
    """ValueError (one line) for a ``quantization_config`` whose weights this reader cannot dequantize."""
    quant = config.get("quantization_config")
    if quant is None:
        return
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    if method not in QUANT_METHODS:
        raise ValueError(f"{source}: quantization_config quant_method={method!r} is not supported; GPT-OSS releases "
                         f"load unquantized or as {', '.join(QUANT_METHODS)} (dequantized on load)")


def _yarn(config: JsonObject) -> YarnScaling | None:
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind != "yarn":
        raise ValueError(f"rope type {kind!r} is not supported for GPT-OSS (yarn or default)")
    return YarnScaling.from_hf(params, int(config.get("max_position_embeddings", 131072)))


def args_from_config(config: JsonObject) -> GptOssArgs:
    """``GptOssArgs`` with every shape a GPT-OSS ``config.json`` states (KeyError: a missing entry)."""
    params = config.get("rope_parameters") or {}
    if config.get("attention_bias", True) is not True:
        raise ValueError("attention_bias=false: GPT-OSS's attention has biases; this reader expects them")
    return GptOssArgs(
        dim=config["hidden_size"], n_layers=config["num_hidden_layers"], n_heads=config["num_attention_heads"],
        n_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        vocab_size=config["vocab_size"], ffn_hidden_size=config["intermediate_size"],
        moe_hidden_size=config["intermediate_size"], num_experts=config["num_local_experts"],
        top_k=config.get("num_experts_per_tok", config.get("experts_per_token", 4)),
        norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        rope_theta=float(config.get("rope_theta", params.get("rope_theta", 150000.0))),
        max_seq_len=int(config.get("max_position_embeddings", 131072)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        sliding_window=int(config.get("sliding_window") or 128), layer_types=tuple(config.get("layer_types") or ()),
        swiglu_limit=float(config.get("swiglu_limit", 7.0)), swiglu_alpha=float(config.get("swiglu_alpha", 1.702)),
        rope_yarn=_yarn(config))


def read_release(path: str | Path) -> GptOssArgs:
    """The args of the GPT-OSS release at ``path`` (folder or config.json); ValueError (one line) otherwise."""
    file, config = read_config(path)
    archs = config.get("architectures") or []
    if config.get("model_type") != MODEL_TYPE or (archs and ARCHITECTURE not in archs):
        raise ValueError(f"{file}: architecture {archs or config.get('model_type')} is not of this family; it reads "
                         f"{ARCHITECTURE} releases")
    check_quantization(config, str(file))
    try:
        return args_from_config(config)
    except KeyError as e:
        raise ValueError(f"{file} lacks the entry {e}") from None
    except ValueError as e:
        raise ValueError(f"{file}: {e}") from None


def hf_config(args: GptOssArgs, *, bos_id: int | None, eos_id: int | None, dtype: torch.dtype) -> JsonObject:
    """A ``config.json`` describing ``args`` in transformers 5's key layout."""
    rope: JsonObject = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_yarn is not None:
        rope = {**args.rope_yarn.to_hf(), "rope_theta": args.rope_theta}
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "hidden_size": args.dim,
        "intermediate_size": args.moe_hidden_size, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
        "num_local_experts": args.num_experts, "num_experts_per_tok": args.top_k, "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps, "max_position_embeddings": args.max_seq_len, "rope_parameters": rope,
        "sliding_window": args.sliding_window, "layer_types": list(args.layer_types),
        "swiglu_limit": args.swiglu_limit, "swiglu_alpha": args.swiglu_alpha, "attention_bias": True,
        "tie_word_embeddings": args.tie_word_embeddings, "router_aux_loss_coef": 0.0, "output_router_logits": False,
        "bos_token_id": bos_id, "eos_token_id": eos_id, "torch_dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
    }


_COMPARED = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "moe_hidden_size", "num_experts",
             "top_k", "norm_eps", "rope_theta", "tie_word_embeddings", "sliding_window", "layer_types",
             "swiglu_limit", "swiglu_alpha", "rope_yarn")


class GptOssConfigFormat:
    """``HFConfigFormat`` (models/common/hf.py) of ``GptOssForCausalLM``."""

    def write(self, args: DecoderConfig, *, bos_id: int | None, eos_id: int | None, dtype: torch.dtype) -> JsonObject:
        return hf_config(_gpt_oss(args), bos_id=bos_id, eos_id=eos_id, dtype=dtype)

    def problems(self, args: DecoderConfig, config: JsonObject, source: str) -> list[str]:
        ours = _gpt_oss(args)
        try:
            check_quantization(config, source)
            theirs = args_from_config(config)
        except (KeyError, ValueError) as e:
            return [f"{source}: {e}" if isinstance(e, KeyError) else str(e)]
        return [f"{source}: {k} is {getattr(theirs, k)!r} there, {getattr(ours, k)!r} in the configured model"
                for k in _COMPARED if getattr(theirs, k) != getattr(ours, k)]


class GptOssHFAdapter(DecoderHFAdapter):
    """The decoder's adapter over GPT-OSS's map (its experts transposed, interleaved or MXFP4-packed: rows)."""

    quant_methods = frozenset(QUANT_METHODS)  # MXFP4 experts: the rows' packed format dequantizes them

    def __init__(self) -> None:
        super().__init__(WeightMap(_templates()), GptOssConfigFormat())
