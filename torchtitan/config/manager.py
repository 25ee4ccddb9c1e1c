"""Turn a TOML file plus command-line overrides into a validated ``JobConfig``.

Precedence is CLI > TOML > defaults. Every problem found is collected and raised
together as one ``ConfigError`` (one line per problem), before any process group
exists, so each rank of a job exits with the same clear message instead of hanging.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import sys
import types
import typing
from typing import Any

try:
    import tomli as tomllib
except ImportError:  # Python >= 3.11 ships the same parser as tomllib
    import tomllib

import tomli_w

from torchtitan.config.job_config import MESH_DIM_NAMES, JobConfig

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


class ConfigError(ValueError):
    """One or more configuration problems; ``problems`` holds one line each."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


@dataclasses.dataclass(frozen=True)
class _FieldType:
    """A config field's type, reduced to what parsing needs."""

    base: type  # int, float, str or bool (the element type for lists)
    optional: bool
    is_list: bool

    def describe(self) -> str:
        name = f"list[{self.base.__name__}]" if self.is_list else self.base.__name__
        return f"{name} or unset" if self.optional else name


def _field_type(hint: Any) -> _FieldType:
    optional = False
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        optional = True
        (hint,) = [a for a in args if a is not type(None)]
    if typing.get_origin(hint) is list:
        return _FieldType(typing.get_args(hint)[0], optional, True)
    return _FieldType(hint, optional, False)


def _section_fields(cfg: JobConfig) -> dict[str, dict[str, tuple[dataclasses.Field, _FieldType]]]:
    """section name -> key -> (dataclass field, parsed type)."""
    out = {}
    for section in dataclasses.fields(cfg):
        cls = type(getattr(cfg, section.name))
        hints = typing.get_type_hints(cls)
        out[section.name] = {f.name: (f, _field_type(hints[f.name])) for f in dataclasses.fields(cls)}
    return out


def _suggest(name: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def _coerce_scalar(value: Any, base: type, from_cli: bool) -> Any:
    """Convert one value to ``base`` or raise ValueError with a short reason."""
    if from_cli and isinstance(value, str):
        text = value.strip()
        if base is bool:
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise ValueError(f"'{value}' is not a boolean (use true or false)")
        if base is int:
            try:
                return int(text)
            except ValueError:
                raise ValueError(f"'{value}' is not an integer") from None
        if base is float:
            try:
                return _finite(float(text), value)
            except ValueError as e:
                raise ValueError(str(e) if "finite" in str(e) else f"'{value}' is not a number") from None
        return text
    # TOML values arrive typed; accept only the matching kind (bool is not an int here).
    if base is bool and isinstance(value, bool):
        return value
    if base is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if base is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return _finite(float(value), value)
    if base is str and isinstance(value, str):
        return value
    raise ValueError(f"{value!r} is a {type(value).__name__}, expected {base.__name__}")


def _finite(number: float, given: Any) -> float:
    """No option takes NaN or an infinity: none has a meaning for them, and TOML-written
    configs would carry them on as ``nan``/``inf`` into every later run."""
    if not math.isfinite(number):
        raise ValueError(f"'{given}' is not a finite number")
    return number


def _coerce(value: Any, ftype: _FieldType, from_cli: bool) -> Any:
    if ftype.optional and from_cli and isinstance(value, str) and value.strip().lower() in ("none", "null"):
        return None
    if ftype.is_list:
        if from_cli and isinstance(value, str):
            items = [v for v in value.split(",") if v.strip()] if value.strip() else []
        elif isinstance(value, list):
            items = value
        else:
            raise ValueError(f"{value!r} is not a list")
        return [_coerce_scalar(v, ftype.base, from_cli) for v in items]
    return _coerce_scalar(value, ftype.base, from_cli)


class ConfigManager:
    """Parses ``argv`` into a ``JobConfig``; see the module docstring."""

    def __init__(self) -> None:
        self.fields = _section_fields(JobConfig())

    # ---- public API -------------------------------------------------------
    def parse_args(self, argv: list[str] | None = None) -> JobConfig:
        argv = sys.argv[1:] if argv is None else list(argv)
        problems: list[str] = []
        overrides = self._parse_cli(argv, problems)
        cfg = JobConfig()
        config_file = next((v for (s, k), v in overrides if (s, k) == ("job", "config_file")), None)
        if config_file:
            self._apply_toml(cfg, config_file, problems)
        for (section, key), raw in overrides:
            self._set(cfg, section, key, raw, f"--{section}.{key}", from_cli=True, problems=problems)
        # Fields that failed to parse kept their defaults, so these checks still make sense.
        problems.extend(validate_config(cfg))
        if problems:
            raise ConfigError(problems)
        return cfg

    def help_text(self) -> str:
        defaults = JobConfig()
        lines = ["usage: train.py [--section.key VALUE | --section.key=VALUE | --bool.flag[=false]] ...", ""]
        lines.append("Lists are comma-separated; precedence is CLI > TOML (--job.config_file) > defaults.")
        for section, keys in self.fields.items():
            lines.append(f"\n[{section}]")
            for key, (f, ftype) in keys.items():
                default = getattr(getattr(defaults, section), key)
                shown = "unset" if default is None else (",".join(map(str, default)) if ftype.is_list else default)
                extra = f" {{{','.join(f.metadata['choices'])}}}" if f.metadata.get("choices") else ""
                lines.append(f"  --{section}.{key} ({ftype.describe()}){extra}")
                lines.append(f"      {f.metadata['help']} (default: {shown})")
        return "\n".join(lines)

    # ---- internals --------------------------------------------------------
    def _all_keys(self) -> list[str]:
        return [f"{s}.{k}" for s, keys in self.fields.items() for k in keys]

    def _parse_cli(self, argv: list[str], problems: list[str]) -> list[tuple[tuple[str, str], str]]:
        overrides: list[tuple[tuple[str, str], str]] = []
        i = 0
        while i < len(argv):
            token = argv[i]
            i += 1
            if not token.startswith("--"):
                problems.append(f"unexpected argument '{token}': options look like --section.key=value")
                continue
            name, has_value, value = token[2:].partition("=")
            section, _, key = name.partition(".")
            known = section in self.fields and key in self.fields[section]
            is_bool = known and self.fields[section][key][1].base is bool and not self.fields[section][key][1].is_list
            if not has_value:
                nxt = argv[i] if i < len(argv) else None
                if is_bool:
                    if nxt is not None and nxt.lower() in _TRUE + _FALSE:
                        value, i = nxt, i + 1
                    else:
                        value = "true"
                elif nxt is not None and not nxt.startswith("--"):
                    value, i = nxt, i + 1
                elif known:
                    problems.append(f"--{name} needs a value")
                    continue
            if not known:
                problems.append(f"unknown option --{name}{_suggest(name, self._all_keys())}")
                continue
            overrides.append(((section, key), value))
        return overrides

    def _apply_toml(self, cfg: JobConfig, path: str, problems: list[str]) -> None:
        if not os.path.isfile(path):
            problems.append(f"config file '{path}' not found: check --job.config_file")
            return
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            problems.append(f"{path}: malformed TOML: {e}")
            return
        for section, table in data.items():
            if section not in self.fields:
                problems.append(f"{path}: unknown section [{section}]{_suggest(section, list(self.fields))}")
                continue
            if not isinstance(table, dict):
                problems.append(f"{path}: '{section}' must be a [section] table")
                continue
            for key, value in table.items():
                if key not in self.fields[section]:
                    problems.append(
                        f"{path}: unknown key '{key}' in [{section}]"
                        f"{_suggest(f'{section}.{key}', self._all_keys())}"
                    )
                    continue
                self._set(cfg, section, key, value, f"{path}: [{section}] {key}", from_cli=False, problems=problems)

    def _set(self, cfg, section, key, raw, where, *, from_cli: bool, problems: list[str]) -> None:
        f, ftype = self.fields[section][key]
        try:
            value = _coerce(raw, ftype, from_cli)
        except ValueError as e:
            problems.append(f"{where}: {e}" + ("" if ftype.base is bool else f" (expected {ftype.describe()})"))
            return
        problem = _check_range(value, f)
        if problem:
            problems.append(f"{where}: {problem}")
            return
        setattr(getattr(cfg, section), key, value)


def _check_range(value: Any, f: dataclasses.Field) -> str | None:
    if value is None:
        return None
    choices, low = f.metadata.get("choices"), f.metadata.get("min")
    if choices and value not in choices:
        return f"'{value}' is not allowed; choose one of {', '.join(choices)}"
    if low is not None and value < low:
        return f"{value} is below the minimum {low}"
    return None


def validate_config(cfg: JobConfig) -> list[str]:
    """Checks that involve more than one field, or values a type cannot express."""
    problems = []
    p, t = cfg.parallelism, cfg.training
    if p.data_parallel_shard_degree == 0 or p.data_parallel_shard_degree < -1:
        problems.append(
            f"--parallelism.data_parallel_shard_degree={p.data_parallel_shard_degree}: "
            "use -1 (the ranks left over) or a degree >= 1"
        )
    if t.global_batch_size == 0 or t.global_batch_size < -1:
        problems.append(f"--training.global_batch_size={t.global_batch_size}: use -1 (derived) or a positive size")
    if len(cfg.optimizer.betas) != 2 or not all(0.0 <= b < 1.0 for b in cfg.optimizer.betas):
        problems.append(f"--optimizer.betas={cfg.optimizer.betas}: give two values in [0, 1), e.g. 0.9,0.95")
    if cfg.lr_scheduler.lr_min > 1.0:
        problems.append(f"--lr_scheduler.lr_min={cfg.lr_scheduler.lr_min}: it is a fraction of the peak lr (0..1)")
    if cfg.lr_scheduler.decay_ratio is not None and cfg.lr_scheduler.decay_ratio > 1.0:
        problems.append(f"--lr_scheduler.decay_ratio={cfg.lr_scheduler.decay_ratio}: it is a fraction (0..1)")
    unknown = [d for d in t.seed_sharded_dims if d not in MESH_DIM_NAMES]
    if unknown:
        problems.append(
            f"--training.seed_sharded_dims: unknown dim(s) {', '.join(unknown)}; choose from {', '.join(MESH_DIM_NAMES)}"
        )
    if len(set(t.seed_sharded_dims)) != len(t.seed_sharded_dims):
        problems.append(f"--training.seed_sharded_dims={','.join(t.seed_sharded_dims)}: a dim is listed twice")
    problems.extend(_validation_problems(cfg))
    from torchtitan.models import model_flavors  # local import keeps config free of torch at import time

    flavors = model_flavors(cfg.model.name)
    if cfg.model.flavor not in flavors:
        problems.append(
            f"--model.flavor={cfg.model.flavor}: unknown for {cfg.model.name}; choose one of {', '.join(flavors)}"
        )
    return problems


def _validation_problems(cfg: JobConfig) -> list[str]:
    """The [validation] section; its data is checked in preflight (it needs the tokenizer and the dp degree)."""
    v, problems = cfg.validation, []
    if v.held_out_fraction is not None and not 0.0 < v.held_out_fraction < 1.0:
        problems.append(f"--validation.held_out_fraction={v.held_out_fraction}: give a fraction strictly between 0 "
                        "and 1 (e.g. 0.01), or leave it unset to hold nothing out")
    if v.steps == 0 or v.steps < -1:
        problems.append(f"--validation.steps={v.steps}: give a number of batches >= 1, or -1 for the whole split")
    has_dataset = v.dataset is not None or v.dataset_path is not None
    if v.enable and not has_dataset and v.held_out_fraction is None:
        problems.append("--validation.enable needs data: set --validation.held_out_fraction (e.g. 0.01) to hold part "
                        "of the training data out, or --validation.dataset / --validation.dataset_path")
    if has_dataset and v.held_out_fraction is not None:
        problems.append("--validation.held_out_fraction and --validation.dataset/dataset_path both say what to "
                        "validate on; set only one of them")
    return problems


def resolve_gradient_accumulation(cfg: JobConfig, dp_degree: int) -> int:
    """Micro-steps per optimizer step, from ``gradient_accumulation_steps`` or ``global_batch_size``."""
    t = cfg.training
    if t.global_batch_size == -1:
        return t.gradient_accumulation_steps
    per_micro_step = t.batch_size * dp_degree
    accum, rest = divmod(t.global_batch_size, per_micro_step)
    if rest or accum < 1:
        raise ConfigError(
            [
                f"--training.global_batch_size={t.global_batch_size} is not a multiple of "
                f"batch_size ({t.batch_size}) x data-parallel degree ({dp_degree}) = {per_micro_step}; "
                "change one of them"
            ]
        )
    if t.gradient_accumulation_steps not in (1, accum):
        raise ConfigError(
            [
                f"--training.gradient_accumulation_steps={t.gradient_accumulation_steps} contradicts "
                f"global_batch_size={t.global_batch_size} (which implies {accum}); set only one of them"
            ]
        )
    return accum


def to_toml(cfg: JobConfig) -> str:
    """The effective config as TOML, which parses back to the same config.

    TOML has no null: an unset value is left out (every optional field defaults to unset)
    and named in a comment.
    """
    sections = []
    for section, values in cfg.to_dict().items():
        text = tomli_w.dumps({section: {k: v for k, v in values.items() if v is not None}})
        unset = [f"# {key} = (unset)\n" for key, value in values.items() if value is None]
        sections.append(text + "".join(unset))
    return "\n".join(sections)
