"""What a (re)joining replica group receives from a live peer, and how it takes it.

torchft asks for the state on its quorum thread, while the training thread runs forward:
calling ``state_dict()`` on FSDP modules there would race with FSDP's own parameter
swapping. So the training thread caches plain references (local shards of parameters and
of the optimizer state: Adam's moments, Muon's momentum; small dicts for the rest) just
before each step starts its quorum, and the callback hands those over. Nothing mutates
them until the step commits, and torchft blocks the commit until a transfer in progress has
been read.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` as a plain tensor sharing its storage (the tensor itself when not a DTensor)."""
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state now, exactly as its first step would: Adam's (zero moments, step 0), or
    Muon's (a zero momentum buffer for each matrix, Adam's state for the rest).

    A group that heals before its first step must be able to receive the peer's state, and it
    takes it key by key into tensors of its own; taking a zero-lr step to create them would
    count a step in Adam's bias correction.
    """
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if state:
                continue
            if group.get("use_muon"):  # torchtitan/optim/muon.py's matrix group
                state["momentum_buffer"] = torch.zeros_like(p)
            else:
                _init_adam_state(group, p, state)


def _init_adam_state(group: Mapping[str, object], p: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
    """torch's Adam/AdamW state of ``p`` before its first step (Muon's non-matrix group keeps the same)."""
    if group.get("fused") or group.get("capturable"):
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
    else:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    if group.get("amsgrad"):
        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


class HealState:
    """The model's and optimizer's local shards, the LR schedule and the trainer's position, by reference."""

    def __init__(self, model_parts: list[torch.nn.Module], optimizer: torch.optim.Optimizer,
                 lr_scheduler: torch.optim.lr_scheduler.LRScheduler,
                 trainer_state: Callable[[], dict[str, Any]], load_trainer_state: Callable[[dict[str, Any]], None]):
        self.model_parts, self.optimizer, self.lr_scheduler = model_parts, optimizer, lr_scheduler
        self._trainer_state, self._load_trainer_state = trainer_state, load_trainer_state
        self._cached: dict[str, Any] | None = None

    def _named_params(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(f"{i}.{name}", p) for i, part in enumerate(self.model_parts) for name, p in part.named_parameters()]

    def refresh(self) -> None:
        """Cache the references to hand over; call on the training thread before the step's quorum starts."""
        named = self._named_params()
        self._cached = {
            "model": {name: _local(p) for name, p in named},
            "optimizer": {name: {k: _local(v) for k, v in self.optimizer.state[p].items()} for name, p in named},
            "lr_scheduler": copy.deepcopy(self.lr_scheduler.state_dict()),
            "lr": [group["lr"] for group in self.optimizer.param_groups],
            "trainer": copy.deepcopy(self._trainer_state()),
        }

    def state_dict(self) -> dict[str, Any]:
        """torchft's callback (quorum thread): the cached references, never a fresh ``state_dict()``."""
        if self._cached is None:
            raise RuntimeError("HealState.refresh() must run before the first quorum")
        return self._cached

    def _check_fits(self, model: Mapping[str, object], optimizer: Mapping[str, Mapping[str, object]]) -> None:
        """Raise, before anything is copied, where the peer's state (its ``model`` and ``optimizer`` parts) does
        not fit this group's: a key left out would keep this group's own value and the groups would drift apart
        silently."""
        for name, p in self._named_params():
            peer, mine = optimizer.get(name), self.optimizer.state[p]
            if name not in model or peer is None or peer.keys() != mine.keys():
                raise RuntimeError(
                    f"fault tolerance heal: the peer's optimizer state of {name} holds {sorted(peer or {})}, this "
                    f"group's {sorted(mine)}; every replica group must train the same model with the same "
                    "--optimizer.name and options")

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a peer's state in place (training thread, inside torchft's ``should_commit``)."""
        self._check_fits(state["model"], state["optimizer"])
        for name, p in self._named_params():
            _local(p).copy_(state["model"][name])
            mine = self.optimizer.state[p]
            for key, value in state["optimizer"][name].items():
                _local(mine[key]).copy_(value)
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        for group, lr in zip(self.optimizer.param_groups, state["lr"]):
            group["lr"] = lr
        self._load_trainer_state(state["trainer"])
