"""Rank side of test_moe_layouts.py: train each MoE layout in turn in one process group.

``moe_entry.py SPEC OUT``, the spec and loop of layout_entry.py. A layout may name ``"resume": name``:
it starts from the step-``RESUME_STEP`` checkpoint that the named layout (trained earlier in this
launch) saved. Rank 0 records for each layout its losses and gradient norms (before clipping), the
digests of the whole model at initialisation and after training, and how far training moved each parameter
(the norm of final - initial), all gathered (under PP from every stage, a parameter that two stages hold
recorded as "differs" unless both copies give the same value), every router bias this rank
holds after training, the ``moe/`` and ``mtp/`` metrics it wrote to TensorBoard (where a layout turns
it on), and where a layout names ``"count_all_to_alls": true``, the expert all-to-alls this rank sent in
training (a dispatch mode's count: one that selective AC answered from a kept output is not sent).
"""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path

import torch
import torch.distributed as dist
from layout_entry import Layout, run_layouts
from torch.utils._python_dispatch import TorchDispatchMode

RESUME_STEP = 3  # test_moe_layouts.HALF


def _digest(t) -> str:  # noqa: ANN001
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


class _CountAllToAlls(TorchDispatchMode):
    """The expert all-to-alls sent, in all and by group label (the two-hop dispatch's hops; "ep" otherwise)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.by_group: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func is torch.ops._c10d_functional.all_to_all_single.default:
            from torchtitan.distributed.group_labels import extra_group_labels

            self.calls += 1
            label = extra_group_labels().get(args[3], "ep")
            self.by_group[label] = self.by_group.get(label, 0) + 1
        return func(*args, **(kwargs or {}))


def train(layout: Layout) -> dict:
    from torchtitan.config import ConfigManager
    from torchtitan.train_step.callbacks import StepEvent, StepPoint
    from torchtitan.trainer import Trainer

    dump = layout.dump
    layout.copy_resume_checkpoint(RESUME_STEP)
    grad_norms: list[float] = []

    def record(event: StepEvent) -> None:
        if event.point is StepPoint.STEP_END:
            grad_norms.append(float(event.output.grad_norm))

    trainer = Trainer(ConfigManager().parse_args([*layout.overrides, f"--job.dump_folder={dump}"]), callbacks=[record])
    world = dist.get_world_size() if trainer.pipeline is not None else 1
    start = _full(trainer.model_parts)
    init = _merged({fqn: _digest(t) for fqn, t in start.items()}, world)
    counter = _CountAllToAlls()
    with counter if layout.spec.get("count_all_to_alls") else contextlib.nullcontext():
        losses = trainer.train()
    end = _full(trainer.model_parts)
    final = _merged({fqn: _digest(t) for fqn, t in end.items()}, world)
    moved = _merged({fqn: float((end[fqn].double() - start[fqn].double()).norm()) for fqn in end}, world)
    return {"losses": losses, "grad_norms": grad_norms, "init": init, "final": final, "moved": moved,
            "biases": _biases(trainer), "moe_metrics": _moe_scalars(dump),
            "all_to_alls": counter.calls, "all_to_alls_by_group": counter.by_group}


def _full(parts: list) -> dict:  # noqa: ANN001 - the model parts -> {fqn: full tensor}
    """Every parameter this rank's stages hold, gathered whole over the layout."""
    from torchtitan.distributed.layout_init import gather_full_state_dict

    return {fqn: t for part in parts for fqn, t in gather_full_state_dict(part).items()}


def _merged(mine: dict, world: int) -> dict:
    """``mine`` ({fqn: value}) merged over the ``world`` ranks (the pipeline's stages; 1: as it is), a parameter
    that two stages hold recorded as "differs" unless both give the same value."""
    import torch.distributed as dist

    if world == 1:
        return mine
    every: list[dict] = [{} for _ in range(world)]
    dist.all_gather_object(every, mine)
    merged: dict = {}
    for held in every:
        for fqn, value in held.items():
            merged[fqn] = value if merged.get(fqn, value) == value else "differs"
    return merged


def _biases(trainer) -> dict[str, list[float]]:  # noqa: ANN001 - a Trainer
    """Every router bias this rank holds."""
    return {fqn: buf.tolist() for part in trainer.model_parts for fqn, buf in part.named_buffers()
            if fqn.endswith("router.expert_bias")}


def _moe_scalars(dump: Path) -> dict[str, list[float]]:
    """The ``moe/...`` and ``mtp/...`` scalars rank 0 wrote to TensorBoard (none without it)."""
    events = sorted({p.parent for p in (dump / "tb").rglob("events.out.tfevents.*")})
    if not events:
        return {}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(events[0]), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]
            if tag.startswith(("moe/", "mtp/"))}


if __name__ == "__main__":
    run_layouts(train)
