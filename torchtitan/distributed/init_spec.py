"""How a parameter is initialised, as data: one ``InitSpec`` per parameter.

A model describes its initialisation with ``param_init_specs()`` (FQN -> InitSpec).
Plain initialisation applies each spec to the parameter, and the layout-invariant
path (``torchtitan/distributed/layout_init.py``) applies it to chunks of the full value.
Both use ``apply_init_spec``, so the specs are the single source of truth.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn


@dataclass(frozen=True)
class InitSpec:
    """How to fill one parameter. For "trunc_normal", `a`/`b` are absolute bounds."""

    kind: Literal["normal", "trunc_normal", "ones", "zeros"]
    std: float = 1.0
    a: float | None = None
    b: float | None = None
    mean: float = 0.0


def trunc_normal_spec(std: float, n_std: float) -> InitSpec:
    return InitSpec("trunc_normal", std=std, a=-n_std * std, b=n_std * std)


@torch.no_grad()
def apply_init_spec(tensor: torch.Tensor, spec: InitSpec, generator: torch.Generator | None = None) -> torch.Tensor:
    """Fill `tensor` in place according to `spec` and return it."""
    if spec.kind == "normal":
        return nn.init.normal_(tensor, mean=spec.mean, std=spec.std, generator=generator)
    if spec.kind == "trunc_normal":
        a = -2.0 * spec.std if spec.a is None else spec.a
        b = 2.0 * spec.std if spec.b is None else spec.b
        return nn.init.trunc_normal_(tensor, mean=spec.mean, std=spec.std, a=a, b=b, generator=generator)
    if spec.kind == "ones":
        return nn.init.ones_(tensor)
    if spec.kind == "zeros":
        return nn.init.zeros_(tensor)
    raise ValueError(f"unknown init kind {spec.kind!r}")
