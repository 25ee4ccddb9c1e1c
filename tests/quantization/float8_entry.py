"""Rank side of test_float8_layouts.py: train each layout in turn in one process group.

``float8_entry.py SPEC OUT``, the spec and loop of tests/distributed/layout_entry.py. A layout may name
``"resume": name``: it starts from the step-``RESUME_STEP`` checkpoint of that layout (trained earlier in
this launch). Rank 0 records the losses, the digests of the whole model when built (not under PP) and
when the first step starts (after a resume: the loaded weights), the digests after step ``RESUME_STEP``,
what the Float8 conversion counted, and its dump folder (where its checkpoints are).
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))  # layout_entry

from layout_entry import Layout, run_layouts  # noqa: E402

RESUME_STEP = 2


def _digests(model) -> dict[str, str]:  # noqa: ANN001 - an nn.Module
    from torchtitan.distributed.layout_init import gather_full_state_dict

    return {fqn: hashlib.sha256(t.detach().cpu().float().contiguous().numpy().tobytes()).hexdigest()
            for fqn, t in gather_full_state_dict(model).items()}


def train(layout: Layout) -> dict:
    from torch.distributed.tensor import DTensor

    from torchtitan.config import ConfigManager
    from torchtitan.train_step.callbacks import StepEvent, StepPoint
    from torchtitan.trainer import Trainer

    dump = layout.dump
    layout.copy_resume_checkpoint(RESUME_STEP)
    seen: dict[str, dict[str, str]] = {}
    trainer: Trainer | None = None

    def record(event: StepEvent) -> None:
        assert trainer is not None
        if trainer.pipeline is not None:
            return
        if event.point is StepPoint.STEP_START and "first_step" not in seen:
            seen["first_step"] = _digests(trainer.model_parts[0])
        if event.point is StepPoint.STEP_END and event.step == RESUME_STEP:
            seen["after_resume_step"] = _digests(trainer.model_parts[0])

    trainer = Trainer(ConfigManager().parse_args([*layout.overrides, f"--job.dump_folder={dump}"]), callbacks=[record])
    init = _digests(trainer.model_parts[0]) if trainer.pipeline is None else {}
    classes = sorted({type(m).__name__ for part in trainer.model_parts for m in part.modules()})
    gathered = sum(type(p.to_local() if isinstance(p, DTensor) else p).__name__ == "WeightWithDynamicFloat8CastTensor"
                   for part in trainer.model_parts for p in part.parameters())
    losses = trainer.train()
    return {"losses": losses, "init": init, "classes": classes, "fp8_gathered_weights": gathered, "dump": str(dump),
            **seen}


if __name__ == "__main__":
    run_layouts(train)
