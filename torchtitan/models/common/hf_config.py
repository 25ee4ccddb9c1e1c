"""A release's ``config.json`` both ways, from each family's table of rows; the Llama-style families' table.

A family states how its ``config.json`` spells its args as ``ConfigField`` rows, one per field:

    ConfigField("n_kv_heads", ("num_key_value_heads",), falsy_default=True, derive=lambda c: c["num_attention_heads"])
    ConfigField("num_experts", ("num_experts", "num_local_experts"), default=0, kind=int, falsy_default=True)

- ``keys``: the entries that state it, the first present one wins; the first is written (``written``
  names another entry, or None: not written). ``default`` (or ``derive``, from the other entries) when
  none is present, or when the entry is false and ``falsy_default`` (``x or default``, as transformers'
  configs are read); ``REQUIRED``: the entry must be there. ``kind`` gives the value our type.
- ``dense``: a field of the experts, this value in a model without them (neither read nor written).
- ``compared``: a release and the configured model must agree on it (preflight names each difference).

``ConfigTable`` holds a family's rows, its architectures, model types, refusals and the entries written
beside the rows (constants, and those made of several fields: the rotary ones); it reads a release into
the family's args (``--model.flavor DIR``), writes ``config.json`` on export and compares. Qwen3,
Qwen3-MoE and Mixtral differ only in how they spell their experts (``ExpertKeys``: ``HFDecoderConfig``);
DeepSeek-V3 and GPT-OSS give their tables in their ``hf.py``, Llama 3 in ``llama3/convert.py``. Reads the
hub's fields (``num_experts``, ``rope_theta``) and those transformers 5 writes (``num_local_experts``,
``rope_parameters``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch

from torchtitan.lfs import check_not_lfs_pointer
from torchtitan.models.common.config import DecoderConfig, JsonObject

ArgsT = TypeVar("ArgsT", bound=DecoderConfig)  # the family's args class: what these functions return


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


class _Marker:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


REQUIRED = _Marker("REQUIRED")  # a row's default: the entry must be there
ARGS_DEFAULT = _Marker("ARGS_DEFAULT")  # read as this: not passed, the args class's own default holds
_FIRST_KEY = _Marker("FIRST_KEY")

Convert = Callable[[Any], object]  # a config.json value (JSON: untyped) as our field's type


def _same(value: object) -> object:
    return value


def int_or_args_default(value: object) -> object:
    """An ``int`` entry as it is; anything else leaves the args' default (``max_position_embeddings``)."""
    return value if isinstance(value, int) else ARGS_DEFAULT


@dataclass(frozen=True)
class ConfigField:
    """One field of our args as a ``config.json`` states it (module docstring)."""

    ours: str
    keys: tuple[str, ...] = ()
    default: object = REQUIRED
    kind: Convert = _same
    falsy_default: bool = False
    derive: Callable[[JsonObject], object] | None = None
    written: str | None | _Marker = _FIRST_KEY
    write_as: Convert = _same
    dense: object = REQUIRED  # REQUIRED here: not a field of the experts
    compared: bool = True

    @property
    def of_experts(self) -> bool:
        return self.dense is not REQUIRED

    @property
    def written_key(self) -> str | None:
        if isinstance(self.written, _Marker):
            return self.keys[0] if self.keys else None
        return self.written

    def read(self, config: JsonObject) -> object:
        """The value ``config`` states (KeyError naming the first key: a required entry is missing)."""
        present = [key for key in self.keys if key in config]
        if present and not (self.falsy_default and not config[present[0]]):
            return self.kind(config[present[0]])
        if self.derive is not None:
            return self.kind(self.derive(config))
        if self.default is REQUIRED:
            raise KeyError(self.keys[0])
        return self.default if self.default is ARGS_DEFAULT else self.kind(self.default)


def _refuse_nothing(config: JsonObject) -> None:
    return None


def _nothing_more(args: DecoderConfig) -> JsonObject:
    return {}


@dataclass(frozen=True)
class ConfigTable(Generic[ArgsT]):
    """A family's ``config.json``: read into its args type, written from args, compared with args.

    ``refuse``: ValueError (one line) for a release the family cannot represent, before any row is read;
    ``more``: the entries written beside the rows' (the rotary ones, made of several fields);
    ``constants``: entries written as they are; ``fixed``: args every release of the family has;
    ``order``: the written entries in this order (a family whose exports keep one), any others after them.
    """

    args_type: type[ArgsT]
    architectures: tuple[str, ...]  # [dense, with experts] (one: the same for both)
    model_types: tuple[str, ...]  # likewise
    rows: tuple[ConfigField, ...]
    other_model_types: tuple[str, ...] = ()  # read too, never written (Kimi K2's kimi_k2)
    refuse: Callable[[JsonObject], None] = _refuse_nothing
    more: Callable[[ArgsT], JsonObject] = _nothing_more
    constants: Mapping[str, object] = field(default_factory=dict)
    fixed: JsonObject = field(default_factory=dict)
    order: tuple[str, ...] = ()

    def _ours(self, args: DecoderConfig) -> ArgsT:
        if not isinstance(args, self.args_type):
            raise TypeError(f"{type(args).__name__} is not the arguments of {self.architectures[0]}")
        return args

    def fields(self, config: JsonObject) -> JsonObject:
        """The args fields ``config`` states (KeyError: a required entry is missing; ValueError: refused)."""
        self.refuse(config)
        out: JsonObject = {}
        for row in self.rows:
            out[row.ours] = row.dense if row.of_experts and not out.get("num_experts") else row.read(config)
        return {k: v for k, v in out.items() if v is not ARGS_DEFAULT}

    def args_of_config(self, config: JsonObject, source: str) -> ArgsT:
        """The args ``config`` describes; ValueError (one line, naming ``source``) for a missing entry or what
        the family cannot represent."""
        try:
            return self.args_type(**self.fixed, **self.fields(config))
        except KeyError as e:
            raise ValueError(f"{source} lacks the entry {e}") from None
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    def read(self, path: str | Path) -> ArgsT:
        """The args with every shape the release at ``path`` (a folder or its config.json) states; ValueError
        (one line) for what is not this family or not supported."""
        file, config = read_config(path)
        archs = config.get("architectures") or []
        types = self.model_types + self.other_model_types
        if config.get("model_type") not in types or (archs and not any(a in self.architectures for a in archs)):
            raise ValueError(f"{file}: architecture {archs or config.get('model_type')} is not of this family; it "
                             f"reads {', '.join(self.architectures)} releases")
        return self.args_of_config(config, str(file))

    def compared(self, args: ArgsT) -> dict[str, object]:
        """The compared fields of ``args``, as the rows read them (a dense model's expert fields: ``dense``)."""
        return {row.ours: row.dense if row.of_experts and not args.num_experts else row.kind(getattr(args, row.ours))
                for row in self.rows if row.compared}

    def problems(self, args: DecoderConfig, config: JsonObject, source: str) -> list[str]:
        """One line per compared field in which ``config`` differs from ``args`` (or the one line refusing it).
        The fields as the rows read them, not args built of them: a shape the args would refuse is named as
        the difference it is."""
        try:
            theirs = self.fields(config)
        except KeyError as e:
            return [f"{source} lacks the entry {e}"]
        except ValueError as e:
            return [f"{source}: {e}"]
        return [f"{source}: {k} is {theirs.get(k)!r} there, {v!r} in the configured model"
                for k, v in self.compared(self._ours(args)).items() if theirs.get(k) != v]

    def write(self, args: DecoderConfig, *, bos_id: int | None, eos_id: int | None, dtype: torch.dtype) -> JsonObject:
        """A ``config.json`` describing ``args`` in the hub's key layout."""
        args = self._ours(args)
        moe = bool(args.num_experts)
        config: JsonObject = {"architectures": [self.architectures[moe % len(self.architectures)]],
                              "model_type": self.model_types[moe % len(self.model_types)]}
        for row in self.rows:
            key = row.written_key
            if key is not None and (moe or not row.of_experts):
                config[key] = row.write_as(getattr(args, row.ours))
        config.update(self.more(args))
        config.update(self.constants)
        config.update({"bos_token_id": bos_id, "eos_token_id": eos_id, "torch_dtype": str(dtype).removeprefix("torch."),
                       "use_cache": True})
        return {**{key: config[key] for key in self.order}, **config}


def _heads(config: JsonObject) -> object:
    return config["num_attention_heads"]


def _head_dim(config: JsonObject) -> object:
    return config["hidden_size"] // config["num_attention_heads"]


def shape_rows(norm_eps: float = 1e-6, ffn: str = "ffn_hidden_size") -> tuple[ConfigField, ...]:
    """The decoder's widths as every Llama-style ``config.json`` states them (a missing ``head_dim`` is
    ``hidden_size / num_attention_heads``; transformers leaves the output untied unless it says so);
    ``ffn``: our name of ``intermediate_size``."""
    return (ConfigField("dim", ("hidden_size",)), ConfigField("n_layers", ("num_hidden_layers",)),
            ConfigField("n_heads", ("num_attention_heads",)),
            ConfigField("n_kv_heads", ("num_key_value_heads",), falsy_default=True, derive=_heads),
            ConfigField("head_dim", ("head_dim",), falsy_default=True, derive=_head_dim),
            ConfigField("vocab_size", ("vocab_size",)), ConfigField(ffn, ("intermediate_size",)),
            ConfigField("norm_eps", ("rms_norm_eps",), default=norm_eps, kind=float),
            ConfigField("tie_word_embeddings", ("tie_word_embeddings",), default=False, kind=bool))


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


def decoder_rows(keys: ExpertKeys) -> tuple[ConfigField, ...]:
    """The Llama-style families' rows: the shape, the plain rotary theta, and the experts as ``keys`` spells them."""
    count = ("num_experts", "num_local_experts")  # both spellings read, the hub's first
    rows = (*shape_rows(), ConfigField("rope_theta", derive=rope_theta, kind=float, written="rope_theta"),
            ConfigField("max_seq_len", ("max_position_embeddings",), default=ARGS_DEFAULT, kind=int_or_args_default,
                        compared=False),
            ConfigField("num_experts", count, default=0, kind=int, falsy_default=True, written=None),
            ConfigField("top_k", ("num_experts_per_tok",), default=2, kind=int, dense=2),
            ConfigField("moe_hidden_size", (keys.width or "intermediate_size",), dense=0,
                        written=keys.width))
    if not keys.layer_options:  # renormalised weights, every layer sparse
        return (*rows, ConfigField("norm_topk_prob", default=True, dense=True, written=None),
                ConfigField("mlp_only_layers", default=(), dense=(), written=None),
                ConfigField("decoder_sparse_step", default=1, dense=1, written=None))
    return (*rows, ConfigField("norm_topk_prob", ("norm_topk_prob",), default=False, kind=bool, dense=True),
            ConfigField("mlp_only_layers", ("mlp_only_layers",), default=(), kind=tuple, falsy_default=True,
                        write_as=list, dense=()),
            ConfigField("decoder_sparse_step", ("decoder_sparse_step",), default=1, kind=int, falsy_default=True,
                        dense=1))


@dataclass(frozen=True)
class HFDecoderConfig(Generic[ArgsT]):
    """The ``config.json`` of a Llama-style family (Qwen3, Qwen3-MoE, Mixtral): its architectures, model types
    and how it spells its experts; ``--model.flavor DIR`` goes through its ``read``."""

    args_type: type[ArgsT]
    architectures: tuple[str, ...]  # [dense, with experts] (one: the same for both)
    model_types: tuple[str, ...]  # likewise
    experts: ExpertKeys

    @cached_property
    def table(self) -> ConfigTable[ArgsT]:
        return ConfigTable(self.args_type, self.architectures, self.model_types, decoder_rows(self.experts),
                           more=self._expert_count, constants={"hidden_act": "silu", "attention_bias": False})

    def _expert_count(self, args: DecoderConfig) -> JsonObject:
        # written with experts only (a dense model's config.json does not mention them)
        return {self.experts.count: args.num_experts, "router_aux_loss_coef": 0.0} if args.num_experts else {}

    def read(self, path: str | Path) -> ArgsT:
        return self.table.read(path)

    def problems(self, args: DecoderConfig, config: JsonObject, source: str) -> list[str]:
        return self.table.problems(args, config, source)

    def write(self, args: DecoderConfig, *, bos_id: int | None, eos_id: int | None, dtype: torch.dtype) -> JsonObject:
        return self.table.write(args, bos_id=bos_id, eos_id=eos_id, dtype=dtype)
