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

from torchtitan.models.common.config import JsonObject
from torchtitan.models.common.hf import DecoderHFAdapter
from torchtitan.models.common.hf_config import ARGS_DEFAULT, ConfigField, ConfigTable, int_or_args_default
from torchtitan.models.common.weight_map import ExportCopy, WeightMap, WeightTemplate
from torchtitan.models.deepseek_v3.args import DeepSeekV3Args
from torchtitan.models.layers import YarnScaling

ARCHITECTURES = ("DeepseekV3ForCausalLM",)
MODEL_TYPES = ("deepseek_v3", "kimi_k2")
NAMING = ("gate_proj", "down_proj", "up_proj")  # each expert's w1, w2, w3 there

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


def _theta(config: JsonObject) -> float:
    return _rope(config)[0]


def _yarn(config: JsonObject) -> YarnScaling | None:
    return _rope(config)[1]


def _refuse(config: JsonObject) -> None:
    _refusals(config)
    _rope(config)  # an unsupported rope type, before any missing entry


def _zero_as_null(rank: int) -> int | None:
    return rank or None  # q_lora_rank: null there for one query projection


def _rope_entries(args: DeepSeekV3Args) -> JsonObject:
    """The entries made of several fields, and those no row reads (MTP stays a training option on load)."""
    rope: JsonObject = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.yarn is not None:
        rope = {**args.yarn.to_hf(), "rope_theta": args.rope_theta}
    return {"rope_parameters": rope, "num_key_value_heads": args.n_heads,
            "num_nextn_predict_layers": args.num_mtp_layers}


# ``config.json`` <-> ``DeepSeekV3Args`` (``common/hf_config.py``): transformers' defaults where a release is
# silent; every row is compared but ``max_seq_len``.
CONFIG = ConfigTable(
    DeepSeekV3Args, ARCHITECTURES, MODEL_TYPES[:1], other_model_types=MODEL_TYPES[1:], refuse=_refuse,
    more=_rope_entries, fixed={"score_func": "sigmoid"},
    constants={"scoring_func": "sigmoid", "topk_method": "noaux_tc", "hidden_act": "silu", "rope_interleave": True,
               "attention_bias": False},
    rows=(ConfigField("dim", ("hidden_size",)), ConfigField("n_layers", ("num_hidden_layers",)),
          ConfigField("n_heads", ("num_attention_heads",)), ConfigField("vocab_size", ("vocab_size",)),
          ConfigField("ffn_hidden_size", ("intermediate_size",)),
          ConfigField("norm_eps", ("rms_norm_eps",), default=1e-6, kind=float),
          ConfigField("rope_theta", derive=_theta, kind=float, written="rope_theta"),
          ConfigField("num_experts", ("n_routed_experts", "num_local_experts"), default=0, kind=int),
          ConfigField("top_k", ("num_experts_per_tok",), default=8, kind=int, falsy_default=True),
          ConfigField("moe_hidden_size", ("moe_intermediate_size",)),
          ConfigField("norm_topk_prob", ("norm_topk_prob",), default=True, kind=bool),
          ConfigField("num_shared_experts", ("n_shared_experts",), default=0, kind=int, falsy_default=True),
          ConfigField("num_groups", ("n_group",), default=1, kind=int, falsy_default=True),
          ConfigField("topk_groups", ("topk_group",), default=1, kind=int, falsy_default=True),
          ConfigField("route_scale", ("routed_scaling_factor",), default=2.5, kind=float),
          ConfigField("q_lora_rank", ("q_lora_rank",), default=0, kind=int, falsy_default=True,
                      write_as=_zero_as_null),
          ConfigField("kv_lora_rank", ("kv_lora_rank",)), ConfigField("qk_nope_head_dim", ("qk_nope_head_dim",)),
          ConfigField("qk_rope_head_dim", ("qk_rope_head_dim",)), ConfigField("v_head_dim", ("v_head_dim",)),
          ConfigField("first_k_dense_replace", ("first_k_dense_replace",), default=0, kind=int, falsy_default=True),
          ConfigField("yarn", derive=_yarn, written=None),
          ConfigField("tie_word_embeddings", ("tie_word_embeddings",), default=False, kind=bool),
          ConfigField("max_seq_len", ("max_position_embeddings",), default=ARGS_DEFAULT, kind=int_or_args_default,
                      compared=False)))


def read_release(path: str | Path) -> DeepSeekV3Args:
    """The args of a release folder (or its config.json); ValueError (one line) for what is not DeepSeek-V3-shaped.

    Multi-token prediction stays off (a training option), whatever ``num_nextn_predict_layers`` says.
    """
    return CONFIG.read(path)


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


class DeepSeekV3HFAdapter(DecoderHFAdapter):
    """The decoder's adapter with DeepSeek-V3's rows: the routing bias has one (the other families' releases
    have no place for it), and the MTP layer's copies of the shared tensors are ``ExportCopy`` rows."""

    def __init__(self) -> None:
        super().__init__(WeightMap(_templates(), MTP_SHARED_COPIES), CONFIG)
