"""``torch.compile`` of a model's blocks (``training.compile``).

Each block of ``model.layers`` is compiled in place (``Module.compile``), so parameter FQNs stay
unchanged; the blocks are identical, so one graph serves them all.
"""

from __future__ import annotations

import logging

import torch

from torchtitan.compat import wait_async_collective
from torchtitan.models.spec import family_model

logger = logging.getLogger(__name__)


def apply_compile(model: torch.nn.Module) -> None:
    """Compile each block in place: blocks are identical, so one graph serves them all.

    A block whose feed-forward is a mixture of experts (a layer of the model's ``moe_layers()``) has its
    attention compiled and its MoE left eager: the MoE sizes its token exchange and counts its tokens from
    values it reads on the host, which a whole-graph compile cannot trace.
    """
    sparse = family_model(model, "apply_compile").moe_layers().keys()
    blocks = dict(model.get_submodule("layers").named_children())
    for key, block in blocks.items():
        if key in sparse:
            block.get_submodule("attention").compile(fullgraph=True)
        else:
            block.compile(fullgraph=True)
    logger.info("Compiled %d transformer blocks%s", len(blocks),
                f" ({len(sparse)} with experts: their attention; the MoE runs eager)" if sparse else "")


def wait_for_embedding_output(model: torch.nn.Module) -> None:
    """Under TP, hand the first (compiled) block the embedding's output waited, with its autograd history.

    The embedding's TP output hook redistributes asynchronously, so its output is a pending
    collective's result, and torch (2.13, 2.14.1) compiles a block fed one as if its input needed no
    gradient (``compat.wait_async_collective``; docs/versions.md). The blocks feed each other plain
    tensors (the residual add waits), and a pipeline stage without the embedding receives plain tensors.
    """
    embedding = family_model(model, "wait_for_embedding_output").tok_embeddings
    if embedding is not None:
        embedding.register_forward_hook(_wait_output)


def _wait_output(module: torch.nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
    return wait_async_collective(output)
