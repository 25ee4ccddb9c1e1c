"""Pipeline stages seen as one model: the checkpoint saves and loads every stage of a rank under the original FQNs."""

from __future__ import annotations

import torch


def model_view(parts: list[torch.nn.Module]) -> torch.nn.Module:
    """One module whose ``named_parameters`` are the union of ``parts``, under their original FQNs.

    Pipeline stages are pruned copies of one model (a stage keeps some of ``layers``
    and sets the modules it lacks to None), so their FQNs never collide. The view
    shares the parts' submodules, never copies them, which lets ``get_model_state_dict``
    and ``get_optimizer_state_dict`` work on one module while the trainer keeps a
    single optimizer over all stages. A single part is its own view.
    """
    if len(parts) == 1:
        return parts[0]
    root = torch.nn.Module()
    for part in parts:
        _merge(root, part, "")
    return root


class _Merged(torch.nn.Module):
    """A container this view made to merge the stages' modules of one name (never a stage's own)."""


def _merge(dst: torch.nn.Module, src: torch.nn.Module, path: str) -> None:
    if any(True for _ in src.named_parameters(recurse=False)):
        raise ValueError(f"pipeline stages hold parameters directly on '{path or '<root>'}'; the checkpoint view "
                         "can only merge stages whose parameters live in submodules")
    for name, child in src.named_children():
        mine = dst._modules.get(name)
        if mine is None:
            dst.add_module(name, child)
        elif mine is not child:
            if not isinstance(mine, _Merged):
                # Never add modules into a stage's own container: merge into a fresh one.
                merged = _Merged()
                _merge(merged, mine, f"{path}{name}.")
                dst._modules[name] = merged
                mine = merged
            _merge(mine, child, f"{path}{name}.")
