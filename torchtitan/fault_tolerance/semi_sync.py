"""DiLoCo and LocalSGD across replica groups (``semi_sync_method``), with torchft's own implementation.

Inner steps are local to a group (FSDP inside it unchanged, no cross-group traffic). Every
``sync_steps`` steps torchft's ``DiLoCo`` averages each parameter's pseudo-gradient (the
reference parameters minus the local ones) over the live groups and takes an outer step
(SGD with Nesterov momentum) from the reference parameters; ``LocalSGD`` averages the
parameters themselves. With ``num_fragments`` > 1 the model is cut into that many fragments
of consecutive blocks, and one fragment is synchronised every ``sync_steps / num_fragments``
steps (Streaming DiLoCo).

torchft runs the sync inside the inner optimizer's step (a post-step hook): the quorum is
taken there, a rejoining group heals there (it receives the peer's reference parameters and
outer momentum through torchft's fragment state, and the trainer's state through
``HealState``), and ``should_commit`` decides the outer step. A discarded sync puts the
reference parameters back and leaves the outer optimizer untouched. Only syncs count as
torchft steps, so ``manager.current_step()`` is the number of committed syncs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from torchtitan.compat import (
    semi_sync_local_step,
    semi_sync_reference,
    semi_sync_save_reference,
    set_semi_sync_local_step,
)
from torchtitan.config.job_config import FaultTolerance
from torchtitan.fault_tolerance.manager_protocol import FTManager

# One fragment holds whole FSDP units: the blocks of ``layers`` and the model's other children.


def _units(part: torch.nn.Module) -> list[torch.nn.Module]:
    units: list[torch.nn.Module] = []
    for child in part.children():
        if isinstance(child, (torch.nn.ModuleDict, torch.nn.ModuleList)):
            units.extend(child.children())
        else:
            units.append(child)
    return [u for u in units if any(True for _ in u.parameters())]


class Fragment(torch.nn.Module):
    """A view of some of the model's modules (not their parent: the model keeps owning them)."""

    def __init__(self, units: list[torch.nn.Module]):
        super().__init__()
        self.units = torch.nn.ModuleList(units)


def model_fragments(model_parts: list[torch.nn.Module], num_fragments: int) -> list[Fragment]:
    """Cut the model into ``num_fragments`` runs of consecutive units, of about equal parameter counts.

    Raises when a parameter would sit in no fragment (it would never be synchronised and the
    groups would drift apart) or when there are fewer units than fragments.
    """
    units = [u for part in model_parts for u in _units(part)]
    if len(units) < num_fragments:
        raise ValueError(f"--fault_tolerance.num_fragments={num_fragments} exceeds the model's {len(units)} "
                         "units (blocks, embedding, norm, output): give at most that many fragments")
    sizes = [sum(p.numel() for p in u.parameters()) for u in units]
    total, fragments, current, done = sum(sizes), [], [], 0
    for i, (unit, size) in enumerate(zip(units, sizes)):
        current.append(unit)
        done += size
        left_units, left_fragments = len(units) - i - 1, num_fragments - len(fragments) - 1
        # Close a fragment at its share of the parameters, keeping a unit for every fragment still to come.
        if left_fragments and (done >= total * (len(fragments) + 1) / num_fragments or left_units == left_fragments):
            fragments.append(Fragment(current))
            current = []
    fragments.append(Fragment(current))
    check_fragments_cover_model(model_parts, fragments)
    return fragments


def check_fragments_cover_model(model_parts: list[torch.nn.Module], fragments: list[torch.nn.Module]) -> None:
    """Every parameter in exactly one fragment: a parameter outside all would never be synchronised."""
    seen: dict[int, int] = {}
    for fragment in fragments:
        for p in fragment.parameters():
            seen[id(p)] = seen.get(id(p), 0) + 1
    names = [(name, seen.get(id(p), 0)) for part in model_parts for name, p in part.named_parameters()]
    wrong = [f"{name} (in {n} fragments)" for name, n in names if n != 1]
    if wrong:
        raise RuntimeError(f"semi-sync fault tolerance: {len(wrong)} parameter(s) are not in exactly one fragment: "
                           f"{', '.join(wrong[:5])}; the groups would drift apart")


def outer_optimizer(fragment: torch.nn.Module, lr: float, momentum: float) -> torch.optim.SGD:
    """DiLoCo's outer optimizer: SGD with Nesterov momentum, its momentum buffers created now (zero).

    Zero buffers make the first outer step bitwise the same as SGD's lazy first step
    (``0 * momentum + g == g``), and give the checkpoint and a heal the same keys from step 0.
    """
    params = list(fragment.parameters())
    opt = torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=momentum > 0)
    if momentum > 0:
        for p in params:
            opt.state[p]["momentum_buffer"] = torch.zeros_like(p.detach())
    opt.register_load_state_dict_post_hook(_own_state)
    return opt


@torch.no_grad()
def _own_state(opt: torch.optim.Optimizer) -> None:
    """Copy the loaded state into memory of our own. torchft heals the outer optimizer with ``load_state_dict``
    of tensors read from the peer's bytes, which load keeps as they are; the outer steps then update them in place."""
    for state in opt.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and key != "step":
                state[key] = value.clone()


def build_semi_sync(ft: FaultTolerance, manager: FTManager, model_parts: list[torch.nn.Module],
                    optimizer: torch.optim.Optimizer) -> tuple[Any, list[torch.nn.Module], list[torch.optim.Optimizer]]:
    """torchft's ``DiLoCo`` or ``LocalSGD`` over the model, entered (its hooks on ``optimizer``).

    Returns the algorithm, its fragments (one, the whole model, for LocalSGD) and the outer optimizers.
    """
    from torchft.local_sgd import DiLoCo, LocalSGD
    from torchft.manager import Manager

    if not isinstance(manager, Manager):  # FTManager is the part the step calls; torchft's algorithms take its class
        raise TypeError(f"fault_tolerance.semi_sync_method={ft.semi_sync_method} needs torchft's Manager (build_manager"
                        f"'s), not a {type(manager).__name__}")
    if ft.semi_sync_method == "local_sgd":
        whole = Fragment([u for part in model_parts for u in _units(part)])
        check_fragments_cover_model(model_parts, [whole])
        algo = LocalSGD(manager, whole, optimizer, sync_every=ft.sync_steps)
        algo.__enter__()
        return algo, [whole], []
    fragments: list[torch.nn.Module] = [*model_fragments(model_parts, ft.num_fragments)]
    outers: list[torch.optim.Optimizer] = [outer_optimizer(f, ft.outer_lr, ft.outer_momentum) for f in fragments]
    algo = DiLoCo(manager, fragments, optimizer, outers, sync_every=ft.sync_steps,
                  fragment_sync_delay=ft.fragment_sync_delay, fragment_update_alpha=ft.fragment_update_alpha)
    algo.__enter__()
    return algo, fragments, outers


def _as_param(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's shard) shaped like the parameter ``like``: a DTensor for a sharded one."""
    if isinstance(like, DTensor):
        return DTensor.from_local(local, like.device_mesh, like.placements, shape=like.shape, stride=like.stride(),
                                  run_check=False)
    return local


class SemiSyncState:
    """What DiLoCo/LocalSGD adds to a checkpoint: reference parameters, outer momentum, and the counters.

    Keyed by the parameters' FQNs and stored as DTensors shaped like the parameters, so DCP
    writes each rank's shard once. ``loaded`` says whether a checkpoint filled it.
    """

    def __init__(self, algo: Any, model_parts: list[torch.nn.Module], fragments: list[torch.nn.Module],
                 outers: list[torch.optim.Optimizer], manager: FTManager):
        self.algo, self.manager, self.loaded = algo, manager, False
        fqn = {id(p): name for part in model_parts for name, p in part.named_parameters()}
        # (fqn, parameter, fragment index, name inside the fragment)
        self.entries = [(fqn[id(p)], p, i, name) for i, f in enumerate(fragments) for name, p in f.named_parameters()]
        self.outers = outers

    def _reference(self, i: int, name: str) -> torch.Tensor:
        return semi_sync_reference(self.algo, i, name)

    def state_dict(self) -> dict[str, Any]:
        counters = {"local_step": semi_sync_local_step(self.algo), **self.manager.state_dict()}
        state: dict[str, Any] = {"counters": counters}
        if self.outers:  # DiLoCo
            state["reference"] = {fqn: _as_param(self._reference(i, name), p) for fqn, p, i, name in self.entries}
            state["outer_momentum"] = {fqn: self.outers[i].state[p]["momentum_buffer"]
                                       for fqn, p, i, _ in self.entries if self.outers[i].state[p]}
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        counters = state["counters"]
        set_semi_sync_local_step(self.algo, int(counters["local_step"]))
        self.manager.load_state_dict({"step": int(counters["step"]),
                                      "batches_committed": int(counters["batches_committed"])})
        for fqn, p, i, name in self.entries if self.outers else []:
            ref = state["reference"][fqn]
            self._reference(i, name).copy_(ref.to_local() if isinstance(ref, DTensor) else ref)
            if fqn in state["outer_momentum"]:
                buf = self.outers[i].state[p]["momentum_buffer"]
                if buf is not state["outer_momentum"][fqn]:
                    buf.copy_(state["outer_momentum"][fqn])
        self.loaded = True

    def restart_from_weights(self) -> None:
        """No semi-sync state was loaded: the current (seeded or loaded) weights are the reference."""
        if self.outers:
            semi_sync_save_reference(self.algo)

    def reference_tensors(self) -> list[torch.Tensor]:
        """The global state every group must hold bitwise after a sync: references and outer momentum."""
        tensors: list[torch.Tensor] = []
        for _fqn, p, i, name in self.entries if self.outers else []:
            tensors.append(self._reference(i, name))
            tensors.extend(self.outers[i].state[p].values())
        return tensors
