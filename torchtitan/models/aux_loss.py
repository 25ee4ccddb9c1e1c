"""A model's auxiliary loss travels with its output: ``(output, aux_loss)``, which the step's loss sums.

In training, a model whose MoE layers have an auxiliary balance loss returns the pair ``WithAuxLoss``:
its usual output and ``aux_loss`` [1] (float32), the sum over its MoE layers of the losses of this
forward, without their coefficient. A plain tuple: a pipeline schedule sends and hands on plain tuples
of tensors only. The step's loss (``train_step/aux_loss.py``) adds ``coeff / forwards`` times it, so
the coefficient and the micro-batch scaling live in the loss alone; nothing is written into the model
from outside.

How the losses reach the output. Each MoE layer hands its forward's loss to the model that runs it
(``MoE.take_aux_loss``: kept by the layer's own forward, taken in the same forward), and a forward hook
that ``return_aux_losses`` puts on the model sums them onto its output. The hook, not the forward's
code, so that it serves any forward of the family (DeepSeek-V3's with multi-token prediction, whose MTP
blocks have MoE layers too) and leaves the blocks' signatures alone. Activation checkpointing is
unaffected: the loss is computed in the original forward, and its backward recomputes the block like
any other path into it (a recompute hands nothing on).

Across pipeline stages the sum is carried beside the hidden state: a stage without the output returns
the plain tuple ``(h, running sum)``, which the schedule sends as two tensors; the next stage's pre-hook
(``accept_carried_aux_loss``, installed after FSDP so that FSDP's mixed-precision cast of forward
inputs never rounds it) takes the running sum off its inputs and the stage's hook adds its own layers'
losses to it. So the last stage's loss sees every stage's losses, and their gradients flow back along
the same chain, through the schedule's own gradient sends. A stage without MoE layers passes the sum on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import torch
from torch import nn

# A training forward's output and the summed auxiliary loss [1] of its MoE layers (and earlier stages').
WithAuxLoss = tuple[torch.Tensor, torch.Tensor]


class AuxLossLayer(Protocol):
    """A layer with an auxiliary loss (``models/moe``'s ``MoE``)."""

    def take_aux_loss(self) -> torch.Tensor | None:
        """The loss of the layer's last training forward, once (None: none since)."""
        ...


class _AuxLossHooks:
    """The hooks of one model (or pipeline stage): see the module docstring."""

    def __init__(self, layers: Callable[[], Mapping[str, AuxLossLayer]]):
        self.layers = layers
        self.carried: torch.Tensor | None = None  # the running sum an earlier stage sent, for this forward

    def take_carried(self, module: nn.Module, args: tuple) -> tuple | None:
        """Forward pre-hook of a later pipeline stage: ``(h, running sum)`` in, ``(h,)`` on to the forward."""
        if not module.training or len(args) != 2:
            return None
        self.carried = args[1]
        return args[:1]

    def add_losses(self, module: nn.Module, args: tuple, output: torch.Tensor | tuple[torch.Tensor, ...]
                   ) -> tuple[torch.Tensor, ...] | None:
        """Forward hook: the output with the running sum plus this forward's losses after it (training only;
        a forward that returns several tensors, multi-token prediction's, keeps them flat before the sum)."""
        carried, self.carried = self.carried, None
        if not module.training:
            return None
        first = output if isinstance(output, torch.Tensor) else output[0]
        if carried is None:  # a leaf, so that every stage's sum needs a gradient (the schedule expects one)
            carried = torch.zeros(1, dtype=torch.float32, device=first.device,
                                  requires_grad=torch.is_grad_enabled())
        total = carried
        for layer in self.layers().values():
            loss = layer.take_aux_loss()
            if loss is not None:
                total = total + loss.reshape(1)
        return (output, total) if isinstance(output, torch.Tensor) else (*output, total)


_HOOKS_ATTR = "_aux_loss_hooks"


def return_aux_losses(model: nn.Module, layers: Callable[[], Mapping[str, AuxLossLayer]]) -> None:
    """Make ``model``'s training forwards return ``WithAuxLoss``, summing the losses of ``layers()`` (called
    after each forward: the layers the model, or a pipeline stage pruned from it, holds). ``layers`` is a
    method of ``model``, so that a deep copy of the model (a pipeline stage) calls its copy's."""
    hooks = _AuxLossHooks(layers)
    setattr(model, _HOOKS_ATTR, hooks)  # plain attribute: deep copies (pipeline stages) copy it with the model
    model.register_forward_hook(hooks.add_losses)


def accept_carried_aux_loss(stage: nn.Module) -> None:
    """Let pipeline stage ``stage`` (past the first) take the running sum an earlier stage sends beside its
    hidden state. Install it after FSDP: it runs before FSDP's input cast (see the module docstring)."""
    hooks = getattr(stage, _HOOKS_ATTR, None)
    if isinstance(hooks, _AuxLossHooks):
        stage.register_forward_pre_hook(hooks.take_carried, prepend=True)


def split_aux_loss(output: torch.Tensor | tuple[torch.Tensor, ...]
                   ) -> tuple[torch.Tensor | tuple[torch.Tensor, ...], torch.Tensor | None]:
    """(the forward's output, its summed auxiliary loss or None) of a ``WithAuxLoss`` or a plain output. The
    loss is the last tensor; a forward that returns several (multi-token prediction's logits per depth) gets
    them back as a tuple."""
    if isinstance(output, torch.Tensor):
        return output, None
    if len(output) < 2:
        raise TypeError(f"a model output of {len(output)} tensors is not a WithAuxLoss (output, auxiliary loss)")
    *rest, aux = output
    return (rest[0] if len(rest) == 1 else tuple(rest)), aux
