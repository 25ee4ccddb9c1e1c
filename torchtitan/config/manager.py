"""Turn a TOML file plus command-line overrides into a ``JobConfig``.

Precedence is CLI > TOML > defaults. Each field is checked on its own while it is
parsed: its type, finiteness, and the ``choices`` and ``min`` its metadata declares.
Every problem found is collected and raised together as one ``ConfigError`` (one
line per problem). Checks that involve several fields, the world size, the model or
files live in one place, ``torchtitan/preflight.py``, which every rank runs before
any process group exists.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import sys
import types
import typing
from collections.abc import Mapping
from typing import Any

try:
    import tomli as tomllib
except ImportError:  # Python >= 3.11 ships the same parser as tomllib
    import tomllib

import tomli_w

from torchtitan.config.job_config import JobConfig

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


def _field_type(hint: object) -> _FieldType:
    optional = False
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        optional = True
        (hint,) = [a for a in args if a is not type(None)]
    if typing.get_origin(hint) is list:
        return _FieldType(typing.get_args(hint)[0], optional, True)
    if not isinstance(hint, type):  # int, float, str, bool: the types a TOML value or a flag parses to
        raise TypeError(f"config field annotation {hint!r}: the parser reads int, float, str, bool, their lists and "
                        "optionals; annotate the field with one of those")
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


def _coerce_scalar(value: object, base: type, from_cli: bool) -> object:
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


def _finite(number: float, given: object) -> float:
    """No option takes NaN or an infinity: none has a meaning for them, and TOML-written
    configs would carry them on as ``nan``/``inf`` into every later run."""
    if not math.isfinite(number):
        raise ValueError(f"'{given}' is not a finite number")
    return number


def _coerce(value: Any, ftype: _FieldType, from_cli: bool, parse: Any = None) -> Any:
    if ftype.base is dict:  # a list of tables; each item read by the field's own parser
        if from_cli and isinstance(value, str):
            return [parse(v, True) for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ValueError(f"{value!r} is not a list of tables")
        return [parse(v, from_cli) for v in value]
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
        config_file = _config_file([v for (s, k), v in overrides if (s, k) == ("job", "config_file")], problems)
        if config_file:
            self._apply_toml(cfg, config_file, problems)
        for (section, key), raw in overrides:
            self._set(cfg, section, key, raw, f"--{section}.{key}", from_cli=True, problems=problems)
        if problems:
            raise ConfigError(problems)
        return cfg

    def help_text(self, written: Mapping[str, str] | None = None) -> str:
        """Every option with its help line; ``written`` replaces the lines of some (``"section.key"``), such as
        those the model registry writes (``models/registry.config_help``)."""
        written = written or {}
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
                lines.append(f"      {written.get(f'{section}.{key}', f.metadata['help'])} (default: {shown})")
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

    def _set(self, cfg: JobConfig, section: str, key: str, raw: Any, where: str, *, from_cli: bool,
             problems: list[str]) -> None:
        f, ftype = self.fields[section][key]
        try:
            value = _coerce(raw, ftype, from_cli, f.metadata.get("parse"))
        except ValueError as e:
            problems.append(f"{where}: {e}" + ("" if ftype.base in (bool, dict) else f" (expected {ftype.describe()})"))
            return
        problem = _check_range(value, f)
        if problem:
            problems.append(f"{where}: {problem}")
            return
        setattr(getattr(cfg, section), key, value)


def _config_file(given: list[str], problems: list[str]) -> str | None:
    """The one TOML file that ``--job.config_file`` names, however often it is given; None for none.

    A launcher that adds its default file before the user's arguments, or a command line built up in
    pieces, can name two files; reading either one would train a config the user did not ask for.
    The same file named twice (by any path) is one file; ``none`` names no file.
    """
    names = [value.strip() for value in given]
    if "" in names:
        problems.append("--job.config_file is empty: name a TOML file, or leave the option out")
        return None
    files = {None if name.lower() in ("none", "null") else os.path.realpath(name): name for name in names}
    if len(files) > 1:
        problems.append(f"--job.config_file is given {len(names)} times, naming {len(files)} different files "
                        f"({', '.join(files.values())}): name one (run_llama_train.sh passes CONFIG_FILE as one "
                        "of them)")
        return None
    return next((name for key, name in files.items() if key is not None), None)


def _check_range(value: Any, f: dataclasses.Field) -> str | None:
    if value is None:
        return None
    choices, low = f.metadata.get("choices"), f.metadata.get("min")
    if choices and value not in choices:
        return f"'{value}' is not allowed; choose one of {', '.join(choices)}"
    if low is not None and value < low:
        return f"{value} is below the minimum {low}"
    return None


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
