"""Rank side of test_moe_layouts.py, started by torchrun: train each MoE layout in turn in one process group.

``moe_entry.py SPEC OUT``, the spec and loop of layout_entry.py. A layout may name ``"resume": name``:
it starts from the step-``RESUME_STEP`` checkpoint that the named layout (trained earlier in this
launch) saved. Rank 0 records for each layout its losses and gradient norms (before clipping), the
digests of the whole model at initialisation (gathered; under PP from every stage, a parameter that two
stages hold recorded as "differs" unless both copies are bitwise equal), every router bias this rank
holds after training, and the ``moe/`` and ``mtp/`` metrics it wrote to TensorBoard (where a layout turns
it on).
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from layout_entry import Layout, run_layouts

RESUME_STEP = 3  # test_moe_layouts.HALF


def _digest(t) -> str:  # noqa: ANN001
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


def train(layout: Layout) -> dict:
    import torch.distributed as dist

    from torchtitan.config import ConfigManager
    from torchtitan.train_step.callbacks import StepEvent, StepPoint
    from torchtitan.trainer import Trainer

    dump, resume = layout.dump, layout.spec.get("resume")
    if resume:
        if dist.get_rank() == 0:
            src = layout.dumps[resume] / "checkpoint" / f"step-{RESUME_STEP}"
            shutil.copytree(src, dump / "checkpoint" / f"step-{RESUME_STEP}")
        dist.barrier()
    grad_norms: list[float] = []

    def record(event: StepEvent) -> None:
        if event.point is StepPoint.STEP_END:
            grad_norms.append(float(event.output.grad_norm))

    trainer = Trainer(ConfigManager().parse_args([*layout.overrides, f"--job.dump_folder={dump}"]), callbacks=[record])
    init = _init_digests(trainer.model_parts, dist.get_world_size() if trainer.pipeline is not None else 1)
    losses = trainer.train()
    return {"losses": losses, "grad_norms": grad_norms, "init": init, "biases": _biases(trainer),
            "moe_metrics": _moe_scalars(dump)}


def _init_digests(parts: list, world: int) -> dict[str, str]:  # noqa: ANN001 - the model parts
    """Every parameter's digest, gathered over its layout; under PP (``world`` > 1) merged over the stages."""
    import torch.distributed as dist

    from torchtitan.distributed.layout_init import gather_full_state_dict

    mine = {fqn: _digest(t) for part in parts for fqn, t in gather_full_state_dict(part).items()}
    if world == 1:
        return mine
    every: list[dict[str, str]] = [{} for _ in range(world)]
    dist.all_gather_object(every, mine)
    merged: dict[str, str] = {}
    for held in every:
        for fqn, digest in held.items():
            merged[fqn] = digest if merged.get(fqn, digest) == digest else "differs"
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
