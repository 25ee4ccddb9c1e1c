"""Rank side of test_compile_tp.py, started by torchrun: train each layout eager, then compiled.

``compile_entry.py SPEC OUT``: SPEC is a JSON file ``{"common": [overrides], "layouts": {name:
[overrides]}}``; every rank trains each layout twice in this one process group (eager, then
``--training.compile``) and rank 0 writes ``{name: {"eager": run, "compiled": run}}`` to OUT, a run
being rank 0's losses and its count of blocks and of compiled blocks.
One launch for every layout keeps the test to one start-up; dynamo's caches are reset between
runs, so each compiled run traces its own layout.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def train(overrides: list[str]) -> dict:
    """This rank's losses, and how many of its blocks run compiled."""
    import torch

    from torchtitan.config import ConfigManager
    from torchtitan.trainer import Trainer

    torch._dynamo.reset()
    trainer = Trainer(ConfigManager().parse_args(overrides))
    blocks = [b for part in trainer.model_parts for b in part.layers.values()]
    compiled = sum(getattr(b, "_compiled_call_impl", None) is not None for b in blocks)  # set by Module.compile
    return {"losses": trainer.train(), "blocks": len(blocks), "compiled_blocks": compiled}


def main(spec_path: str, out_path: str) -> None:
    import torch.distributed as dist

    from torchtitan.logging_setup import init_logger

    init_logger()
    spec = json.loads(Path(spec_path).read_text())
    results: dict[str, dict[str, dict]] = {}
    for i, (name, overrides) in enumerate(spec["layouts"].items()):
        results[name] = {}
        for mode, extra in (("eager", []), ("compiled", ["--training.compile"])):
            start = time.monotonic()
            dump = f"--job.dump_folder={Path(out_path).parent / f'{i}-{mode}'}"
            results[name][mode] = train([*spec["common"], dump, *overrides, *extra])
            print(f"compile_entry: {name} {mode}: {time.monotonic() - start:.0f}s", file=sys.stderr, flush=True)
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
