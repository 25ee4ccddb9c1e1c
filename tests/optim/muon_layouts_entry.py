"""Rank side of test_muon_layouts.py: train each Muon layout in turn in one process group.

``muon_layouts_entry.py SPEC OUT``, the spec and loop of tests/distributed/layout_entry.py. A layout may name
``"resume": name`` and ``"resume_dump": folder``: it starts from the step-``RESUME_STEP`` checkpoint that layout
saved in ``folder`` (a run of another launch, so on another number of ranks). Rank 0 records for each layout
its losses, how far training moved every parameter (final - initial, gathered whole from every rank and
stage) saved as a torch file whose path it returns, how many matrices of each shape ``newton_schulz``
orthogonalized at each step, summed over the ranks, and the ``attn/`` scalars (QK-clip's log) it wrote to
TensorBoard where a layout turns it on.
"""

from __future__ import annotations

import dataclasses
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))  # layout_entry

from layout_entry import Layout, run_layouts  # noqa: E402

RESUME_STEP = 3  # test_muon_layouts.SAVE_STEP


def train(layout: Layout) -> dict:
    from torchtitan.config import ConfigManager
    from torchtitan.optim import muon
    from torchtitan.train_step.callbacks import StepEvent, StepPoint
    from torchtitan.trainer import Trainer

    if "resume_dump" in layout.spec:
        source = {layout.spec["resume"]: Path(layout.spec["resume_dump"])}
        layout = dataclasses.replace(layout, dumps={**layout.dumps, **source})
    layout.copy_resume_checkpoint(RESUME_STEP)
    this_step: Counter[str] = Counter()
    per_step: list[dict[str, int]] = []
    newton_schulz = muon.newton_schulz

    def counting(matrices: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
        # Every orthogonalization goes through here (one process's and the owners' alike): count its matrices.
        this_step[f"{matrices.size(-2)}x{matrices.size(-1)}"] += matrices[..., 0, 0].numel()
        return newton_schulz(matrices, steps, dtype)

    def close_step(event: StepEvent) -> None:
        if event.point is StepPoint.STEP_END:
            per_step.append(dict(this_step))
            this_step.clear()

    muon.newton_schulz = counting
    try:
        trainer = Trainer(ConfigManager().parse_args([*layout.overrides, f"--job.dump_folder={layout.dump}"]),
                          callbacks=[close_step])
        start = _full(trainer.model_parts)
        losses = trainer.train()
        end = _full(trainer.model_parts)
    finally:
        muon.newton_schulz = newton_schulz
    moved = {fqn: (end[fqn].double() - start[fqn].double()).float() for fqn in end}
    matrices = _matrices(trainer.model_parts)
    if trainer.pipeline is not None:  # each rank holds its own stages
        moved = _merged(moved)
        matrices = _summed([matrices])[0]
    return {"losses": losses, "moved": _saved(moved, layout.dump / "moved.pt"),
            "orthogonalized": _summed(per_step), "matrices": matrices, "attn": _attention_scalars(layout.dump)}


def _matrices(parts: list[torch.nn.Module]) -> dict[str, int]:
    """The matrices Muon holds in ``parts``, by shape: a fused weight's parts apart, an expert weight's experts."""
    from torchtitan.optim.muon_params import split_params

    groups = split_params(parts)
    out: Counter[str] = Counter()
    for p in groups.matrices:
        for rows in groups.row_parts.get(p, (p.shape[-2],)):
            out[f"{rows}x{p.shape[-1]}"] += p.shape[:-2].numel()
    return dict(out)


def _attention_scalars(dump: Path) -> dict[str, list[float]]:
    """The ``attn/...`` scalars (QK-clip's max logit and clipped heads) rank 0 wrote to TensorBoard (none if off)."""
    events = sorted({p.parent for p in (dump / "tb").rglob("events.out.tfevents.*")})
    if not events:
        return {}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(events[0]), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"] if tag.startswith("attn/")}


def _full(parts: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """Every parameter this rank's stages hold, gathered whole over the layout."""
    from torchtitan.distributed.layout_init import gather_full_state_dict

    return {fqn: t.detach().clone() for part in parts for fqn, t in gather_full_state_dict(part).items()}


def _merged(mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``mine`` merged over every rank (a pipeline's stages hold different parameters)."""
    every: list[dict[str, torch.Tensor]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, mine)
    merged: dict[str, torch.Tensor] = {}
    for held in every:
        merged.update({fqn: t for fqn, t in held.items() if fqn not in merged})
    return merged


def _saved(tensors: dict[str, torch.Tensor], path: Path) -> str:
    if dist.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(tensors, path)
    return str(path)


def _summed(per_step: list[dict[str, int]]) -> list[dict[str, int]]:
    """Each step's matrices orthogonalized, by shape, summed over the ranks."""
    every: list[list[dict[str, int]]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, per_step)
    assert len({len(steps) for steps in every}) == 1, [len(steps) for steps in every]
    return [dict(sum((Counter(steps[i]) for steps in every), Counter())) for i in range(len(per_step))]


if __name__ == "__main__":
    run_layouts(train)
