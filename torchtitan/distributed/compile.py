"""``torch.compile`` of a model's blocks (``training.compile``).

Each block of ``model.layers`` is compiled in place (``Module.compile``), so parameter FQNs stay
unchanged; the blocks are identical, so one graph serves them all.
"""

from __future__ import annotations

import logging
from typing import cast

import torch

logger = logging.getLogger(__name__)


def apply_compile(model: torch.nn.Module) -> None:
    """Compile each block in place: blocks are identical, so one graph serves them all."""
    layers = cast(torch.nn.ModuleDict, model.layers)  # nn.Module types a submodule as Tensor | Module
    for block in layers.values():
        block.compile(fullgraph=True)
    logger.info("Compiled %d transformer blocks", len(layers))
