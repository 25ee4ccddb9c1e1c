"""Rank side of test_moe_layouts.py, started by torchrun: train each MoE layout in turn in one process group.

``moe_entry.py SPEC OUT``: SPEC is a JSON file ``{"common": [overrides], "layouts": {name: {"overrides":
[...], "resume": name or null}}}``. A layout with ``resume`` starts from the step-``RESUME_STEP`` checkpoint
that the named layout (trained earlier in this launch) saved. Rank 0 writes ``{name: run}`` to OUT, a run
being its losses and gradient norms (before clipping), the digests of the whole model at initialisation
(gathered; not under PP), every router bias this rank holds after training, and the ``moe/`` metrics it
wrote to TensorBoard (where a layout turns it on).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

RESUME_STEP = 5


def _digest(t) -> str:  # noqa: ANN001
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


def train(overrides: list[str], dump: Path, resume_from: Path | None) -> dict:
    import torch.distributed as dist

    from torchtitan.config import ConfigManager
    from torchtitan.distributed.layout_init import gather_full_state_dict
    from torchtitan.train_step.callbacks import StepEvent, StepPoint
    from torchtitan.trainer import Trainer

    if resume_from is not None:
        if dist.get_rank() == 0:
            src = resume_from / "checkpoint" / f"step-{RESUME_STEP}"
            shutil.copytree(src, dump / "checkpoint" / f"step-{RESUME_STEP}")
        dist.barrier()
    grad_norms: list[float] = []

    def record(event: StepEvent) -> None:
        if event.point is StepPoint.STEP_END:
            grad_norms.append(float(event.output.grad_norm))

    trainer = Trainer(ConfigManager().parse_args([*overrides, f"--job.dump_folder={dump}"]), callbacks=[record])
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


def main(spec_path: str, out_path: str) -> None:
    import torch.distributed as dist

    from torchtitan.logging_setup import init_logger

    init_logger()
    spec = json.loads(Path(spec_path).read_text())
    root = Path(out_path).parent
    dumps = {name: root / f"run{i}" for i, name in enumerate(spec["layouts"])}
    results: dict[str, dict] = {}
    for name, layout in spec["layouts"].items():
        start = time.monotonic()
        resume = layout.get("resume")
        results[name] = train([*spec["common"], *layout["overrides"]], dumps[name],
                              dumps[resume] if resume else None)
        if dist.get_rank() == 0:  # shown with the failure if a later layout hangs
            print(f"moe_entry: {name}: {time.monotonic() - start:.0f}s", file=sys.stderr, flush=True)
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
