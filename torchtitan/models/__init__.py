"""Model registry: family name -> flavors (sizes)."""

from __future__ import annotations

MODEL_NAMES = ("llama3",)


def model_flavors(name: str) -> dict:
    """The flavors (``ModelArgs`` by flavor name) of a model family."""
    if name == "llama3":
        from torchtitan.models.llama3 import llama3_flavors

        return llama3_flavors
    raise ValueError(f"unknown model '{name}'; choose one of {', '.join(MODEL_NAMES)}")
