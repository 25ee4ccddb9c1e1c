"""Rank side of test_moe_layouts.py, started by torchrun: train each MoE layout in turn in one process group.

``moe_entry.py SPEC OUT``, the spec and loop of layout_entry.py. A layout may name ``"resume": name``:
it starts from the step-``RESUME_STEP`` checkpoint that the named layout (trained earlier in this
launch) saved. Rank 0 records for each layout its losses and gradient norms (before clipping), the
digests of the whole model at initialisation (gathered; not under PP), every router bias this rank
holds after training, and the ``moe/`` metrics it wrote to TensorBoard (where a layout turns it on).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from layout_entry import Layout, run_layouts

RESUME_STEP = 3  # test_moe_layouts.HALF


def _digest(t) -> str:  # noqa: ANN001
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


def train(layout: Layout) -> dict:
    from torchtitan.config import ConfigManager
    from torchtitan.distributed.layout_init import gather_full_state_dict
    from torchtitan.train_step.callbacks import StepEvent, StepPoint
    from torchtitan.trainer import Trainer

    dump = layout.dump
    layout.copy_resume_checkpoint(RESUME_STEP)
    grad_norms: list[float] = []

    def record(event: StepEvent) -> None:
        if event.point is StepPoint.STEP_END:
            grad_norms.append(float(event.output.grad_norm))

    trainer = Trainer(ConfigManager().parse_args([*layout.overrides, f"--job.dump_folder={dump}"]), callbacks=[record])
    init = {}
    if trainer.pipeline is None:
        init = {fqn: _digest(t) for fqn, t in gather_full_state_dict(trainer.model_parts[0]).items()}
    losses = trainer.train()
    return {"losses": losses, "grad_norms": grad_norms, "init": init, "biases": _biases(trainer),
            "moe_metrics": _moe_scalars(dump)}


def _biases(trainer) -> dict[str, list[float]]:  # noqa: ANN001 - a Trainer
    """Every router bias this rank holds."""
    return {fqn: buf.tolist() for part in trainer.model_parts for fqn, buf in part.named_buffers()
            if fqn.endswith("router.expert_bias")}


def _moe_scalars(dump: Path) -> dict[str, list[float]]:
    """The ``moe/...`` scalars rank 0 wrote to TensorBoard (none without it)."""
    events = sorted({p.parent for p in (dump / "tb").rglob("events.out.tfevents.*")})
    if not events:
        return {}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(events[0]), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"] if tag.startswith("moe/")}


if __name__ == "__main__":
    run_layouts(train)
