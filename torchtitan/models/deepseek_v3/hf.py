"""DeepSeek-V3's Hugging Face layout: ``config.json`` both ways, and the weights' names.

Releases (DeepSeek-V3, Kimi K2, Moonlight) and transformers' ``DeepseekV3ForCausalLM`` store the rotary
parts in adjacent pairs (``rope_interleave``), as we do, so no rows are permuted. Experts are one tensor
per expert there and stacked here, as for Qwen3-MoE (``models/common/hf.py``). The router's learned
auxiliary-loss-free bias is ``mlp.gate.e_score_correction_bias`` there: written on export, read on load.

A release keeps its multi-token prediction module as layer ``n_layers`` (``model.layers.61`` in the 671B:
``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``, a block like any other, and its own copies of the
embedding and the output head, ``embed_tokens`` and ``shared_head.head``). Our MTP modules are keyed by that
index (``mtp.61``), so the map names them alike. With ``--model.mtp_layers`` 0 the model has no such
parameters and the layer is left unread; on export the MTP layer is written whole, the two copies being our
shared embedding and output. transformers' ``DeepseekV3ForCausalLM`` has no MTP module and skips the layer.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

import torch

from torchtitan.models.common import hf_config as common_config
from torchtitan.models.common.config import DecoderConfig, JsonObject
from torchtitan.models.common.hf import DecoderHFAdapter
from torchtitan.models.common.weight_map import ExportCopy, WeightMap, WeightTemplate
from torchtitan.models.deepseek_v3.args import DeepSeekV3Args
from torchtitan.models.layers import YarnScaling

ARCHITECTURES = ("DeepseekV3ForCausalLM",)
MODEL_TYPES = ("deepseek_v3", "kimi_k2")
NAMING = ("gate_proj", "down_proj", "up_proj")  # each expert's w1, w2, w3 there

# The fields a release and the configured model must agree on (a mismatch is one line each).
FIELDS = ("dim", "n_layers", "n_heads", "vocab_size", "ffn_hidden_size", "norm_eps", "rope_theta", "num_experts",
          "top_k", "moe_hidden_size", "norm_topk_prob", "num_shared_experts", "num_groups", "topk_groups",
          "route_scale", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
          "first_k_dense_replace", "yarn", "tie_word_embeddings")


def _rope(config: JsonObject) -> tuple[float, YarnScaling | None]:
    """(rope_theta, YaRN or None) from ``rope_scaling`` (releases) or ``rope_parameters`` (transformers 5)."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type")) or "default"
    theta = float(config.get("rope_theta", params.get("rope_theta", 10000.0)))
    if kind == "default":
        return theta, None
    if kind != "yarn":
        raise ValueError(f"rope type {kind!r} is not supported for DeepSeek-V3 (default or yarn)")
    return theta, YarnScaling.from_hf(scaling, int(config["max_position_embeddings"]))


def _refusals(config: JsonObject) -> None:
    """ValueError, one line, for a release this model cannot represent."""
    if config.get("rope_interleave", True) is False:
        raise ValueError("rope_interleave false (rotary halves, not pairs) is not supported; DeepSeek-V3 releases "
                         "use pairs")
    if config.get("attention_bias"):
        raise ValueError("attention_bias true is not supported (DeepSeek-V3's projections have no bias)")
    if config.get("hidden_act", "silu") != "silu" or config.get("scoring_func", "sigmoid") != "sigmoid":
        raise ValueError(f"hidden_act {config.get('hidden_act')!r} / scoring_func {config.get('scoring_func')!r}: "
                         "only silu experts with sigmoid routing are DeepSeek-V3's")


def fields_of_config(config: JsonObject) -> JsonObject:
    """``FIELDS`` as a DeepSeek-V3 ``config.json`` states them (transformers' defaults where it is silent)."""
    _refusals(config)
    theta, yarn = _rope(config)
    return {
        "dim": config["hidden_size"], "n_layers": config["num_hidden_layers"],
        "n_heads": config["num_attention_heads"], "vocab_size": config["vocab_size"],
        "ffn_hidden_size": config["intermediate_size"], "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "rope_theta": theta, "num_experts": int(config.get("n_routed_experts", config.get("num_local_experts", 0))),
        "top_k": int(config.get("num_experts_per_tok") or 8), "moe_hidden_size": config["moe_intermediate_size"],
        "norm_topk_prob": bool(config.get("norm_topk_prob", True)),
        "num_shared_experts": int(config.get("n_shared_experts") or 0),
        "num_groups": int(config.get("n_group") or 1), "topk_groups": int(config.get("topk_group") or 1),
        "route_scale": float(config.get("routed_scaling_factor", 2.5)),
        "q_lora_rank": int(config.get("q_lora_rank") or 0), "kv_lora_rank": config["kv_lora_rank"],
        "qk_nope_head_dim": config["qk_nope_head_dim"], "qk_rope_head_dim": config["qk_rope_head_dim"],
        "v_head_dim": config["v_head_dim"], "first_k_dense_replace": int(config.get("first_k_dense_replace") or 0),
        "yarn": yarn, "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
    }


def fields_of_args(args: DeepSeekV3Args) -> JsonObject:
    out = {k: getattr(args, k) for k in FIELDS}
    out["norm_eps"], out["rope_theta"], out["route_scale"] = (float(args.norm_eps), float(args.rope_theta),
                                                              float(args.route_scale))
    return out


def read_release(path: str | Path) -> DeepSeekV3Args:
    """The args of a release folder (or its config.json); ValueError (one line) for what is not DeepSeek-V3-shaped.

    Multi-token prediction stays off (a training option), whatever ``num_nextn_predict_layers`` says.
    """
    file, config = common_config.read_config(path)
    archs = config.get("architectures") or []
    if config.get("model_type") not in MODEL_TYPES or (archs and not any(a in ARCHITECTURES for a in archs)):
        raise ValueError(f"{file}: architecture {archs or config.get('model_type')} is not of this family; it reads "
                         f"{', '.join(ARCHITECTURES)} releases")
    try:
        fields = fields_of_config(config)
        max_pos = config.get("max_position_embeddings")
        if isinstance(max_pos, int):
            fields["max_seq_len"] = max_pos
        return DeepSeekV3Args(score_func="sigmoid", **fields)
    except KeyError as e:
        raise ValueError(f"{file} lacks the entry {e}") from None
    except ValueError as e:
        raise ValueError(f"{file}: {e}") from None


def hf_config(args: DeepSeekV3Args, *, bos_id: int | None, eos_id: int | None, dtype: torch.dtype) -> JsonObject:
    """A ``config.json`` of ``DeepseekV3ForCausalLM`` describing ``args`` (the hub's key layout)."""
    rope: dict[str, float | int | bool | str] = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.yarn is not None:
        rope = {**args.yarn.to_hf(), "rope_theta": args.rope_theta}
    return {
        "architectures": list(ARCHITECTURES), "model_type": "deepseek_v3", "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_size, "moe_intermediate_size": args.moe_hidden_size,
        "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_heads,
        "n_routed_experts": args.num_experts, "n_shared_experts": args.num_shared_experts,
        "num_experts_per_tok": args.top_k, "n_group": args.num_groups, "topk_group": args.topk_groups,
        "routed_scaling_factor": args.route_scale, "norm_topk_prob": args.norm_topk_prob,
        "first_k_dense_replace": args.first_k_dense_replace, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "q_lora_rank": args.q_lora_rank or None, "kv_lora_rank": args.kv_lora_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim, "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim, "hidden_act": "silu", "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_theta, "rope_parameters": rope,
        "rope_interleave": True, "attention_bias": False, "vocab_size": args.vocab_size, "bos_token_id": bos_id,
        "eos_token_id": eos_id, "tie_word_embeddings": args.tie_word_embeddings,
        "num_nextn_predict_layers": args.num_mtp_layers, "torch_dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
    }


def _templates() -> list[WeightTemplate]:
    """Our names <-> the release's (``common/weight_map.py``); ``scale``: an FP8 release's block scales."""
    layer, ours = "model.layers.{layer}.", "layers.{layer}."
    rows = [WeightTemplate("tok_embeddings.weight", "model.embed_tokens.weight"),
            WeightTemplate("norm.weight", "model.norm.weight"),
            WeightTemplate("output.weight", "lm_head.weight")]
    plain = {"attention_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
             "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
             "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
             "feed_forward.router.gate.weight": "mlp.gate.weight",
             "feed_forward.router.expert_bias": "mlp.gate.e_score_correction_bias"}
    projections = {"attention.wq.weight": "self_attn.q_proj", "attention.wq_a.weight": "self_attn.q_a_proj",
                   "attention.wq_b.weight": "self_attn.q_b_proj",
                   "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa",
                   "attention.wkv_b.weight": "self_attn.kv_b_proj", "attention.wo.weight": "self_attn.o_proj",
                   "feed_forward.w1.weight": "mlp.gate_proj", "feed_forward.w2.weight": "mlp.down_proj",
                   "feed_forward.w3.weight": "mlp.up_proj",
                   "feed_forward.shared_experts.w1.weight": "mlp.shared_experts.gate_proj",
                   "feed_forward.shared_experts.w2.weight": "mlp.shared_experts.down_proj",
                   "feed_forward.shared_experts.w3.weight": "mlp.shared_experts.up_proj"}
    # the MTP modules (``mtp.<layer>``): their own parts, then a block as any layer's
    rows += [WeightTemplate("mtp.{layer}." + k, layer + v) for k, v in MTP_PARTS.items()]
    rows.append(WeightTemplate("mtp.{layer}.eh_proj.weight", layer + "eh_proj.weight"))
    for prefix in (ours, "mtp.{layer}.block."):
        rows += [WeightTemplate(prefix + k, layer + v) for k, v in plain.items()]
        rows += [WeightTemplate(prefix + k, layer + v + ".weight") for k, v in projections.items()]
        for w, theirs in zip(("w1", "w2", "w3"), NAMING):
            name = layer + "mlp.experts.{expert}." + theirs
            rows.append(WeightTemplate(prefix + "feed_forward.experts." + w, name + ".weight"))
    return rows


# An MTP module's own parts, ours -> the release layer's; beside them its copies of the shared embedding and head.
MTP_PARTS = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "norm.weight": "shared_head.norm.weight"}
# The release's MTP layer holds its own copies of the embedding and the head: ours, shared, written once more
MTP_SHARED_COPIES = tuple(ExportCopy(ours, "model.layers.{layer}." + theirs, per="mtp.{layer}.")
                          for ours, theirs in (("tok_embeddings.weight", "embed_tokens.weight"),
                                               ("output.weight", "shared_head.head.weight")))


class DeepSeekV3Config:
    """The ``HFConfigFormat`` (``common/hf.py``) of DeepSeek-V3 releases."""

    def write(self, args: DecoderConfig, *, bos_id: int | None, eos_id: int | None, dtype: torch.dtype) -> JsonObject:
        return hf_config(cast(DeepSeekV3Args, args), bos_id=bos_id, eos_id=eos_id, dtype=dtype)

    def problems(self, args: DecoderConfig, config: JsonObject, source: str) -> list[str]:
        ours, theirs = fields_of_args(cast(DeepSeekV3Args, args)), fields_of_config(config)
        return [f"{source}: {k} is {theirs.get(k)!r} there, {v!r} in the configured model"
                for k, v in ours.items() if theirs.get(k) != v]


class DeepSeekV3HFAdapter(DecoderHFAdapter):
    """The decoder's adapter with DeepSeek-V3's rows: the routing bias has one (the other families' releases
    have no place for it), and the MTP layer's copies of the shared tensors are ``ExportCopy`` rows."""

    def __init__(self) -> None:
        super().__init__(WeightMap(_templates(), MTP_SHARED_COPIES), DeepSeekV3Config())
