"""Model registry: family name -> flavors (sizes), or a flavor read from a release."""

from __future__ import annotations

import os

MODEL_NAMES = ("llama3",)


def model_flavors(name: str) -> dict:
    """The flavors (``ModelArgs`` by flavor name) of a model family."""
    if name == "llama3":
        from torchtitan.models.llama3 import llama3_flavors

        return llama3_flavors
    raise ValueError(f"unknown model '{name}'; choose one of {', '.join(MODEL_NAMES)}")


def is_flavor_path(flavor: str) -> bool:
    """Whether ``--model.flavor`` names a release (a path) rather than a flavor by name."""
    return os.sep in flavor or flavor.endswith(".json") or os.path.exists(os.path.expanduser(flavor))


def model_args(name: str, flavor: str):
    """The ``ModelArgs`` of ``flavor``: a flavor name, or a release folder / config.json / params.json.

    ValueError (one line, naming the option) when it is neither.
    """
    flavors = model_flavors(name)
    if flavor in flavors:
        return flavors[flavor]
    if is_flavor_path(flavor):
        from torchtitan.models.llama3.release import args_from_release

        try:
            return args_from_release(flavor)
        except (ValueError, OSError) as e:
            raise ValueError(f"--model.flavor={flavor}: {e}") from None
    raise ValueError(f"--model.flavor={flavor}: unknown for {name}; choose one of {', '.join(flavors)}, or give "
                     "a release folder (config.json or params.json) or the file itself")
