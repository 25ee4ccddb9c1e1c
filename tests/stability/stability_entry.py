"""Rank side of test_bad_steps.py: train each layout in turn in one process group.

``stability_entry.py SPEC OUT``, the spec and loop of tests/distributed/layout_entry.py. Rank 0 records
for each layout, after every step: one digest of the whole model and one of the whole optimizer state
(every parameter's full value, gathered over the shards and the pipeline stages), the step's loss and
z-loss as the trainer computed them, and the guard's skipped-step count.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))  # layout_entry.py

from layout_entry import Layout, run_layouts  # noqa: E402


def _digest(t) -> str:  # noqa: ANN001 - a tensor
    return hashlib.sha256(t.detach().cpu().contiguous().reshape(-1).view(-1).numpy().tobytes()).hexdigest()


def _state_digests(trainer) -> tuple[str, str]:  # noqa: ANN001 - a Trainer
    """(model, optimizer) digests over every rank's full parameters and optimizer states (a collective)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from torchtitan.checkpoint import model_view

    def full(t):  # noqa: ANN001, ANN202
        return t.full_tensor() if isinstance(t, DTensor) else t

    view = model_view(trainer.model_parts)
    names = {id(p): fqn for fqn, p in view.named_parameters()}
    mine = {"model": {fqn: _digest(full(p)) for fqn, p in view.named_parameters()},
            "optim": {f"{names[id(p)]}/{key}": _digest(full(v)) for p, state in trainer.optimizer.state.items()
                      for key, v in sorted(state.items())}}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    merged = {kind: dict(sorted({k: v for d in everyone for k, v in d[kind].items()}.items()))
              for kind in ("model", "optim")}
    return (hashlib.sha256(repr(merged["model"]).encode()).hexdigest(),
            hashlib.sha256(repr(merged["optim"]).encode()).hexdigest())


def train(layout: Layout) -> dict:
    from torchtitan.config import ConfigManager
    from torchtitan.train_step.callbacks import StepEvent, StepPoint
    from torchtitan.trainer import Trainer

    steps: list[dict] = []
    trainer: Trainer | None = None

    def record(event: StepEvent) -> None:
        if event.point is StepPoint.STEP_END:
            assert trainer is not None
            out = event.output
            model, optim = _state_digests(trainer)
            steps.append({"step": event.step, "model": model, "optim": optim, "loss": float(out.loss),
                          "z_loss": float(out.terms["z_loss"]) if "z_loss" in out.terms else None,
                          "skipped": None if out.skipped is None else bool(out.skipped),
                          "lr": out.lr})

    trainer = Trainer(ConfigManager().parse_args([*layout.overrides, f"--job.dump_folder={layout.dump}"]),
                      callbacks=[record])
    trainer.train()
    guard = trainer.guard
    return {"steps": steps, "skipped_total": None if guard is None else int(guard.skipped),
            "spike_stats_count": None if guard is None else int(guard.loss_stats.count)}


if __name__ == "__main__":
    run_layouts(train)
