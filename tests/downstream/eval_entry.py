"""Rank side of test_eval_layouts.py: train each layout with ``[eval]`` in one process group.

``eval_entry.py SPEC OUT``, the spec and loop of tests/distributed/layout_entry.py. For each layout
rank 0 records the downstream scores of every step that scored, the ``eval/`` and
``validation/bpb`` scalars it wrote to TensorBoard, and the bytes of text each validation counted;
and it saves the whole trained model (every pipeline stage's parameters gathered) as ``model.pt``
in the layout's dump folder, for the test's brute-force reference.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))

from layout_entry import Layout, run_layouts  # noqa: E402


def train(layout: Layout) -> dict:
    import torch
    import torch.distributed as dist

    from torchtitan.config import ConfigManager
    from torchtitan.distributed.layout_init import gather_full_state_dict
    from torchtitan.trainer import Trainer

    dump = layout.dump
    trainer = Trainer(ConfigManager().parse_args([*layout.overrides, f"--job.dump_folder={dump}"]))
    trainer.train()
    state: dict[str, torch.Tensor] = {}
    for part in trainer.model_parts:  # a pipeline rank holds some stages: the others hold the rest
        state.update(gather_full_state_dict(part))
    states: list[dict[str, torch.Tensor] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    if dist.get_rank() == 0:
        torch.save({k: v for s in states if s for k, v in s.items()}, dump / "model.pt")
    return {"scores": {str(step): s for step, s in trainer.eval_scores.items()}, "tensorboard": _scalars(dump),
            "validation_bytes": {str(step): r.text_bytes for step, r in trainer.validation_results.items()}}


def _scalars(dump: Path) -> dict[str, list[float]]:
    """The ``eval/`` and ``validation/bpb`` scalars rank 0 wrote to TensorBoard."""
    events = sorted({p.parent for p in (dump / "tb").rglob("events.out.tfevents.*")})
    if not events:
        return {}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(events[0]), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]
            if tag.startswith("eval/") or tag == "validation/bpb"}


if __name__ == "__main__":
    run_layouts(train)
