"""The model families by ``--model.name``: ``get_model_spec(name)``, and a family's flavors or a release.

A family registers its ``ModelSpec`` from its own ``spec.py`` (``register_model_spec``); the
registry imports those modules on the first look-up, so importing it stays cheap and a family is
added by listing its module in ``_FAMILY_MODULES`` (docs/models.md).
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchtitan.models.common.config import DecoderConfig
    from torchtitan.models.spec import ModelSpec

_FAMILY_MODULES = ("torchtitan.models.llama3.spec", "torchtitan.models.qwen3.spec", "torchtitan.models.mixtral.spec",
                  "torchtitan.models.deepseek_v3.spec", "torchtitan.models.gpt_oss.spec")
_SPECS: dict[str, ModelSpec[DecoderConfig]] = {}


def register_model_spec(spec: ModelSpec[DecoderConfig]) -> None:
    """Make ``spec`` known under ``spec.name`` (a family's spec.py calls this when imported)."""
    if spec.name in _SPECS and _SPECS[spec.name] is not spec:
        raise ValueError(f"model family {spec.name!r} is registered twice")
    _SPECS[spec.name] = spec


def _load_families() -> dict[str, ModelSpec[DecoderConfig]]:
    for module in _FAMILY_MODULES:
        importlib.import_module(module)
    return _SPECS


def model_names() -> tuple[str, ...]:
    return tuple(_load_families())


def get_model_spec(name: str) -> ModelSpec[DecoderConfig]:
    """The spec of family ``name``; ValueError (one line, naming the option and the families) when unknown."""
    specs = _load_families()
    if name not in specs:
        raise ValueError(f"--model.name={name}: unknown model family; choose one of {', '.join(specs)}")
    return specs[name]


def spec_for_args(args: object) -> ModelSpec[DecoderConfig]:
    """The spec of the family whose arguments ``args`` are (for code handed args alone, e.g. a weights reader)."""
    for spec in _load_families().values():
        if isinstance(args, spec.args_type):
            return spec
    raise TypeError(f"{type(args).__name__} is the arguments of no registered model family")


def model_flavors(name: str) -> dict[str, DecoderConfig]:
    """The flavors (args by flavor name) of a model family."""
    return dict(get_model_spec(name).flavors)


def config_help() -> dict[str, str]:
    """The ``--help`` lines of the options whose values the registry knows (``ConfigManager.help_text``):
    every family, and every family's flavors. The config module cannot write them itself: the families
    import it."""
    families = "; ".join(f"{name}: {', '.join(model_flavors(name))}" for name in model_names())
    return {
        "model.name": f"Model family, as the model registry names it: {', '.join(model_names())}",
        "model.flavor": f"Model size within the family ({families}), or a release to read the shape from: a folder "
                        "holding a Hugging Face config.json or Meta's params.json, or the file itself",
    }


def is_flavor_path(flavor: str) -> bool:
    """Whether ``--model.flavor`` names a release (a path) rather than a flavor by name."""
    return os.sep in flavor or flavor.endswith(".json") or os.path.exists(os.path.expanduser(flavor))


def model_args(name: str, flavor: str) -> DecoderConfig:
    """The args of ``flavor``: a flavor name, or a release folder / config.json / params.json.

    ValueError (one line, naming the option) when it is neither.
    """
    spec = get_model_spec(name)
    if flavor in spec.flavors:
        return spec.flavors[flavor]
    if is_flavor_path(flavor):
        try:
            return spec.read_release(flavor)
        except (ValueError, OSError) as e:
            raise ValueError(f"--model.flavor={flavor}: {e}") from None
    raise ValueError(f"--model.flavor={flavor}: unknown for {name}; choose one of {', '.join(spec.flavors)}, or give "
                     "a release folder (config.json or params.json) or the file itself")
