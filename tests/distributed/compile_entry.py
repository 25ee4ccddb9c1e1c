"""Rank side of test_compile_tp.py: train each layout eager, then compiled.

``compile_entry.py SPEC OUT``, the spec and loop of layout_entry.py: every rank trains each layout
twice in the one process group (eager, then ``--training.compile``) and rank 0 records
``{"eager": run, "compiled": run}``, a run being rank 0's losses and its count of blocks and of
compiled blocks. Dynamo's caches are reset between runs, so each compiled run traces its own layout.
"""

from __future__ import annotations

from typing import cast

from layout_entry import Layout, run_layouts

MODES = (("eager", []), ("compiled", ["--training.compile"]))


def train_once(overrides: list[str]) -> dict:
    """This rank's losses, and how many of its blocks run compiled."""
    import torch

    from torchtitan.config import ConfigManager
    from torchtitan.models.common.decoder import Decoder
    from torchtitan.trainer import Trainer

    torch._dynamo.reset()
    trainer = Trainer(ConfigManager().parse_args(overrides))
    blocks = [b for part in trainer.model_parts for b in cast(Decoder, part).layers.values()]
    compiled = sum(getattr(b, "_compiled_call_impl", None) is not None for b in blocks)  # set by Module.compile
    return {"losses": trainer.train(), "blocks": len(blocks), "compiled_blocks": compiled}


def train(layout: Layout) -> dict[str, dict]:
    """The layout eager, then compiled, each in a dump folder of its own."""
    return {mode: train_once([*layout.overrides, f"--job.dump_folder={layout.dump / mode}", *extra])
            for mode, extra in MODES}


if __name__ == "__main__":
    run_layouts(train)
