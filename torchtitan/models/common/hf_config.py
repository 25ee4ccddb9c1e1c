"""The decoder's shape in a Hugging Face ``config.json`` (Qwen3, Qwen3-MoE, Mixtral), both ways.

Reads the hub's fields (``num_experts``, ``rope_theta``) and those transformers 5 writes
(``num_local_experts``, ``rope_parameters``). A family is an ``HFDecoderConfig``: its architectures,
model types and how it spells its experts (``ExpertKeys``); ``--model.flavor DIR`` goes through its
``read``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

import torch

from torchtitan.lfs import check_not_lfs_pointer
from torchtitan.models.common.args import DecoderArgs
from torchtitan.models.common.config import DecoderConfig, JsonObject

ArgsT = TypeVar("ArgsT", bound=DecoderArgs)  # the family's args class: what these functions return

# The fields compared between a release and the configured model.
FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "ffn_hidden_size", "norm_eps",
          "rope_theta", "tie_word_embeddings", "num_experts", "top_k", "moe_hidden_size", "norm_topk_prob",
          "mlp_only_layers", "decoder_sparse_step")


def read_config(path: str | Path) -> tuple[Path, JsonObject]:
    """(the file, its JSON object) of ``path``: a release folder or its ``config.json``; ValueError (one line)."""
    p = Path(path).expanduser()
    file = p if p.is_file() else p / "config.json"
    if not file.is_file():
        raise ValueError(f"{path}: neither a flavor name nor a Hugging Face release (no config.json there)")
    return file, read_json_object(file)


def read_json_object(file: Path) -> JsonObject:
    """A release's JSON config (config.json, params.json) as a dict; ValueError (one line) when it is an LFS
    pointer, not JSON, or not an object. Every family's release reader goes through it."""
    check_not_lfs_pointer(file)
    try:
        config = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} is not a JSON object")
    return config


def rope_config(config: JsonObject) -> tuple[float, str, JsonObject]:
    """(theta, scaling type, scaling entries) from the released layout (``rope_theta`` + ``rope_scaling``) or
    transformers 5's ``rope_parameters``; the type is ``default`` for none."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    return float(config.get("rope_theta", params.get("rope_theta", 10000.0))), kind, scaling


def rope_theta(config: JsonObject) -> float:
    """The rotary theta of a release without frequency scaling (ValueError for another type)."""
    theta, kind, _ = rope_config(config)
    if kind != "default":
        raise ValueError(f"rope type {kind!r} is not supported (only the default rotary embedding)")
    return theta


def shape_fields(config: JsonObject) -> JsonObject:
    """The decoder's widths as every Llama-style ``config.json`` states them (a missing ``head_dim`` is
    ``hidden_size / num_attention_heads``; transformers leaves the output untied unless it says so)."""
    n_heads = config["num_attention_heads"]
    return {"dim": config["hidden_size"], "n_layers": config["num_hidden_layers"], "n_heads": n_heads,
            "n_kv_heads": config.get("num_key_value_heads") or n_heads,
            "head_dim": config.get("head_dim") or config["hidden_size"] // n_heads,
            "vocab_size": config["vocab_size"], "ffn_hidden_size": config["intermediate_size"],
            "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
            "tie_word_embeddings": bool(config.get("tie_word_embeddings", False))}


@dataclass(frozen=True)
class ExpertKeys:
    """How a family's ``config.json`` spells its experts.

    Qwen3-MoE: ``num_experts`` and ``moe_intermediate_size``, with ``norm_topk_prob``, ``mlp_only_layers``
    and ``decoder_sparse_step``. Mixtral: ``num_local_experts``, every layer sparse, experts as wide as
    ``intermediate_size``, weights renormalised.
    """

    count: str  # the key written for the expert count (both spellings are read)
    width: str | None  # the expert width's key; None: intermediate_size
    layer_options: bool  # norm_topk_prob, mlp_only_layers and decoder_sparse_step are stated


QWEN3_EXPERTS = ExpertKeys("num_experts", "moe_intermediate_size", True)
MIXTRAL_EXPERTS = ExpertKeys("num_local_experts", None, False)


def fields_of_config(config: JsonObject, keys: ExpertKeys) -> JsonObject:
    """``FIELDS`` as a ``config.json`` states them."""
    experts = int(config.get("num_experts", config.get("num_local_experts", 0)) or 0)
    fields = {**shape_fields(config), "rope_theta": rope_theta(config), "num_experts": experts,
              "top_k": int(config.get("num_experts_per_tok", 2)) if experts else 2,
              "moe_hidden_size": 0, "norm_topk_prob": True, "mlp_only_layers": (), "decoder_sparse_step": 1}
    if experts:
        fields.update(moe_hidden_size=config[keys.width or "intermediate_size"])
    if experts and keys.layer_options:
        fields.update(norm_topk_prob=bool(config.get("norm_topk_prob", False)),
                      mlp_only_layers=tuple(config.get("mlp_only_layers") or ()),
                      decoder_sparse_step=int(config.get("decoder_sparse_step", 1) or 1))
    return fields


def fields_of_args(args: DecoderArgs) -> JsonObject:
    out = {k: getattr(args, k) for k in FIELDS}
    out["norm_eps"], out["rope_theta"] = float(args.norm_eps), float(args.rope_theta)
    if not args.num_experts:  # meaningless without experts
        out.update(top_k=2, moe_hidden_size=0, norm_topk_prob=True, mlp_only_layers=(), decoder_sparse_step=1)
    return out


@dataclass(frozen=True)
class HFDecoderConfig(Generic[ArgsT]):
    """A family's ``config.json``: read into its args type, written from args, compared with args."""

    args_type: type[ArgsT]
    architectures: tuple[str, ...]  # [dense, with experts] (one: the same for both)
    model_types: tuple[str, ...]  # likewise
    experts: ExpertKeys

    def _ours(self, args: DecoderConfig) -> ArgsT:
        if not isinstance(args, self.args_type):
            raise TypeError(f"{type(args).__name__} is not the arguments of {self.architectures[0]}")
        return args

    def read(self, path: str | Path) -> ArgsT:
        """The args with every shape the release at ``path`` states; ValueError (one line) for what is not
        this family or not supported."""
        file, config = read_config(path)
        archs = config.get("architectures") or []
        if config.get("model_type") not in self.model_types or (archs and not any(a in self.architectures
                                                                                  for a in archs)):
            raise ValueError(f"{file}: architecture {archs or config.get('model_type')} is not of this family; it "
                             f"reads {', '.join(self.architectures)} releases")
        try:
            fields = fields_of_config(config, self.experts)
            max_pos = config.get("max_position_embeddings")
            if isinstance(max_pos, int):
                fields["max_seq_len"] = max_pos
            return self.args_type(**fields)
        except KeyError as e:
            raise ValueError(f"{file} lacks the entry {e}") from None
        except ValueError as e:
            raise ValueError(f"{file}: {e}") from None

    def problems(self, args: DecoderConfig, config: JsonObject, source: str) -> list[str]:
        ours, theirs = fields_of_args(self._ours(args)), fields_of_config(config, self.experts)
        return [f"{source}: {k} is {theirs.get(k)!r} there, {v!r} in the configured model"
                for k, v in ours.items() if theirs.get(k) != v]

    def write(self, args: DecoderConfig, *, bos_id: int | None, eos_id: int | None, dtype: torch.dtype) -> JsonObject:
        """A ``config.json`` describing ``args`` in the hub's key layout."""
        args = self._ours(args)
        moe = bool(args.num_experts)
        config: JsonObject = {
            "architectures": [self.architectures[moe % len(self.architectures)]],
            "model_type": self.model_types[moe % len(self.model_types)], "hidden_size": args.dim,
            "intermediate_size": args.ffn_hidden_size, "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
            "hidden_act": "silu", "max_position_embeddings": args.max_seq_len, "rms_norm_eps": args.norm_eps,
            "rope_theta": args.rope_theta, "vocab_size": args.vocab_size, "bos_token_id": bos_id,
            "eos_token_id": eos_id, "tie_word_embeddings": args.tie_word_embeddings, "attention_bias": False,
            "torch_dtype": str(dtype).removeprefix("torch."), "use_cache": True,
        }
        if moe:
            config.update({self.experts.count: args.num_experts, "num_experts_per_tok": args.top_k,
                           "router_aux_loss_coef": 0.0})
        if moe and self.experts.width is not None:
            config[self.experts.width] = args.moe_hidden_size
        if moe and self.experts.layer_options:
            config.update({"norm_topk_prob": args.norm_topk_prob, "mlp_only_layers": list(args.mlp_only_layers),
                           "decoder_sparse_step": args.decoder_sparse_step})
        return config
