"""Llama 3's hyper-parameters as a release spells them: Hugging Face's ``config.json`` and Meta's ``params.json``.

No file I/O: the model fields a release must agree on, read from either file (``config.json`` through
``LLAMA_CONFIG``, a ``ConfigTable`` of rows as every family's; ``params.json`` by its own reader, which
fills in what Meta's file leaves unsaid), and the ``config.json`` written for ``LlamaForCausalLM``. The weight
names and the rotary layout of q/k are the decoder's declarative map (``models/common/weight_map.py``); Meta's
names are ours (``adapter.py``).
"""

from __future__ import annotations

import dataclasses

import torch

from torchtitan.models.common.config import JsonObject
from torchtitan.models.common.hf_config import ARGS_DEFAULT, ConfigField, ConfigTable, rope_config, shape_rows
from torchtitan.models.llama3.args import ModelArgs, ffn_hidden_dim

# ---------------------------------------------------------------- hyper-parameters

# The fields compared between a weights release and the configured model, with their meaning.
FIELD_HELP = {
    "dim": "model width", "n_layers": "layers", "n_heads": "attention heads", "n_kv_heads": "key/value heads",
    "head_dim": "head width",
    "ffn_dim": "FFN width", "rope_theta": "rope theta", "rope_scaling": "rope scaling", "norm_eps": "norm eps",
    "vocab_size": "vocabulary", "tie_word_embeddings": "tied embeddings",
}
# Llama 3.2 text models, as (dim, n_layers): Meta's params.json states neither their rope
# scaling factor (32, where 3.1 has 8) nor that their output is the embedding.
_LLAMA32_SHAPES = {(2048, 16), (3072, 28)}


def model_fields(args: ModelArgs) -> JsonObject:
    """What a weights release must agree on with ``args`` (see ``FIELD_HELP``)."""
    scaling = args.rope_scaling_params()
    return {"dim": args.dim, "n_layers": args.n_layers, "n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads,
            "head_dim": args.head_dim, "ffn_dim": args.ffn_dim, "rope_theta": float(args.rope_theta),
            "rope_scaling": None if scaling is None else {k: float(v) for k, v in scaling.items()},
            "norm_eps": float(args.norm_eps), "vocab_size": args.vocab_size,
            "tie_word_embeddings": args.tie_word_embeddings}


def _llama3_rope_only(config: JsonObject) -> None:
    """ValueError for a rotary scaling type other than none/'default' and 'llama3'."""
    kind = rope_config(config)[1]
    if kind not in ("default", "llama3"):
        raise ValueError(f"rope type {kind!r} is not supported (only none/'default' and 'llama3' "
                         "scaling, as Llama 3 releases use)")


def _hf_rope_theta(config: JsonObject) -> object:
    return rope_config(config)[0]


def _hf_rope_scaling(config: JsonObject) -> dict[str, float] | None:
    """The Llama 3.1 scaling from ``rope_scaling`` or the newer ``rope_parameters`` (None: no scaling)."""
    _, kind, scaling = rope_config(config)
    if kind == "default":
        return None
    return {"factor": float(scaling["factor"]), "low_freq_factor": float(scaling["low_freq_factor"]),
            "high_freq_factor": float(scaling["high_freq_factor"]),
            "original_context": float(scaling["original_max_position_embeddings"])}


def _rope_scaling_entry(args: ModelArgs) -> JsonObject:
    scaling = args.rope_scaling_params()
    return {"rope_scaling": None if scaling is None else {
        "rope_type": "llama3", "factor": scaling["factor"], "low_freq_factor": scaling["low_freq_factor"],
        "high_freq_factor": scaling["high_freq_factor"],
        "original_max_position_embeddings": int(scaling["original_context"])}}


# ``LlamaForCausalLM``'s config.json: the rows read ``model_fields`` (the rotary ones first: an unsupported
# or incomplete scaling is named before a missing width). This model derives the head width from
# dim / n_heads; a release may state another one (refused by ``args_with_fields``). ``max_position_embeddings``
# is written only: ``release.py`` reads it from either file, Meta's too. A release's differences are named by
# ``field_differences`` over ``model_fields`` (the rotary scaling as its parameters, the names Meta's file is
# compared under too), not by the table's ``problems``.
LLAMA_CONFIG = ConfigTable(
    ModelArgs, ("LlamaForCausalLM",), ("llama",),
    (ConfigField("rope_theta", derive=_hf_rope_theta, kind=float, written="rope_theta"),
     ConfigField("rope_scaling", derive=_hf_rope_scaling, written=None),
     *shape_rows(ffn="ffn_dim"),
     ConfigField("max_seq_len", default=ARGS_DEFAULT, written="max_position_embeddings", compared=False)),
    refuse=_llama3_rope_only, more=_rope_scaling_entry,
    constants={"hidden_act": "silu", "attention_bias": False, "mlp_bias": False},
    order=("architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
           "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings",
           "rms_norm_eps", "rope_theta", "rope_scaling", "vocab_size", "bos_token_id", "eos_token_id",
           "tie_word_embeddings", "attention_bias", "mlp_bias", "torch_dtype", "use_cache"))


def fields_from_hf_config(config: JsonObject) -> JsonObject:
    """``model_fields`` as a Hugging Face ``config.json`` states them (KeyError: a missing entry; ValueError:
    an unsupported rotary scaling)."""
    return LLAMA_CONFIG.fields(config)


def fields_from_meta_params(params: JsonObject, flavor: ModelArgs | None = None) -> JsonObject:
    """``model_fields`` as Meta's ``params.json`` states them.

    params.json says only whether scaling is on (``use_scaled_rope``), and nothing about
    tied embeddings. Keys ``rope_scaling_factor`` (etc.) and ``tie_word_embeddings`` win when
    present; else the values are the configured ``flavor``'s, or with no flavor those of the
    published release of that shape (3.2 1B/3B: factor 32, tied; others: factor 8, untied).
    """
    n_heads = params["n_heads"]
    probe = ModelArgs(dim=params["dim"], n_layers=1, n_heads=n_heads, n_kv_heads=params.get("n_kv_heads"),
                      multiple_of=params.get("multiple_of", 256), ffn_dim_multiplier=params.get("ffn_dim_multiplier"))
    llama32 = (params["dim"], params["n_layers"]) in _LLAMA32_SHAPES
    if flavor is None:
        flavor = ModelArgs(rope_scaling=True, rope_scaling_factor=32.0 if llama32 else 8.0,
                           tie_word_embeddings=llama32)
    scaling = None
    if params.get("use_scaled_rope"):
        ours = flavor.rope_scaling_params() or ModelArgs(rope_scaling=True).rope_scaling_params()
        assert ours is not None, "rope_scaling=True gives the parameters"
        scaling = {k: float(params.get(f"rope_scaling_{k}", params.get(k, v))) for k, v in ours.items()}
        if "rope_scaling_factor" in params or "scale_factor" in params:
            factor = params["rope_scaling_factor"] if "rope_scaling_factor" in params else params["scale_factor"]
            scaling["factor"] = float(factor)
    return {"dim": params["dim"], "n_layers": params["n_layers"], "n_heads": n_heads,
            "head_dim": params["dim"] // n_heads, "n_kv_heads": params.get("n_kv_heads") or n_heads,
            "ffn_dim": ffn_hidden_dim(probe),
            "rope_theta": float(params.get("rope_theta", 500000.0)), "rope_scaling": scaling,
            "norm_eps": float(params.get("norm_eps", 1e-5)), "vocab_size": params["vocab_size"],
            "tie_word_embeddings": bool(params.get("tie_word_embeddings", flavor.tie_word_embeddings))}


def field_differences(expected: JsonObject, found: JsonObject, source: str) -> list[str]:
    """One line per field that differs, naming both values."""
    return [f"{source}: {FIELD_HELP[k]} ({k}) is {found[k]!r} there, {expected[k]!r} in the configured model"
            for k in FIELD_HELP if found.get(k) != expected[k]]


def hf_config(args: ModelArgs, *, bos_id: int | None, eos_id: int | None, dtype: torch.dtype) -> JsonObject:
    """A ``config.json`` for ``LlamaForCausalLM`` describing ``args`` (the released key layout)."""
    return LLAMA_CONFIG.write(args, bos_id=bos_id, eos_id=eos_id, dtype=dtype)


def args_with_fields(base: ModelArgs, fields: JsonObject) -> ModelArgs:
    """``base`` with the shapes of ``fields`` (a flavor read from a release; tests)."""
    if fields["head_dim"] * fields["n_heads"] != fields["dim"]:
        raise ValueError(f"head width {fields['head_dim']} x {fields['n_heads']} heads differs from the model width "
                         f"{fields['dim']}; this model needs head_dim = dim / n_heads (as every Llama 3 release has)")
    scaling = fields["rope_scaling"]
    return dataclasses.replace(
        base, dim=fields["dim"], n_layers=fields["n_layers"], n_heads=fields["n_heads"],
        n_kv_heads=fields["n_kv_heads"], vocab_size=fields["vocab_size"], norm_eps=fields["norm_eps"],
        rope_theta=fields["rope_theta"], ffn_hidden_size=fields["ffn_dim"],
        tie_word_embeddings=fields.get("tie_word_embeddings", False),
        rope_scaling=scaling is not None,
        **({} if scaling is None else {
            "rope_scaling_factor": scaling["factor"], "rope_low_freq_factor": scaling["low_freq_factor"],
            "rope_high_freq_factor": scaling["high_freq_factor"],
            "rope_original_max_seq_len": int(scaling["original_context"])}),
    )
