"""Train several layouts in one torchrun launch: the spec, the rank side's loop and the test side's launch.

A test calls ``launch(entry, root, common, layouts, nproc=...)``: it writes the spec ``{"common":
[overrides], "layouts": {name: {"overrides": [...], ...}}}`` under ``root`` and starts the entry
script (``ENTRY SPEC OUT``) under torchrun. The entry calls ``run_layouts(train)``: every rank
trains each layout in turn, in spec order, in the one process group (one start-up for the lot),
and rank 0 writes ``{name: train(layout)}`` to OUT, which ``launch`` returns. What a run records
is the entry's own, and so is any key of a layout other than ``overrides``.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
# The ranks import this checkout's torchtitan, not an installed one, however the entry was started.
sys.path.insert(0, str(REPO))


@dataclass(frozen=True)
class Layout:
    """One layout of the spec, as an entry's ``train`` gets it."""

    name: str
    overrides: list[str]  # the spec's common overrides, then the layout's own
    dump: Path  # this layout's dump folder (not made yet): the entry passes it as --job.dump_folder
    spec: dict[str, Any]  # the layout as the spec wrote it, for the entry's own keys
    dumps: dict[str, Path]  # every layout's dump folder, by name: a layout may start from an earlier one's checkpoint

    def copy_resume_checkpoint(self, step: int) -> None:
        """Where the layout names ``"resume": name``: rank 0 copies that earlier layout's step-``step``
        checkpoint into this dump folder, so that the trainer starts from it; every rank waits for the copy."""
        import shutil

        import torch.distributed as dist

        resume = self.spec.get("resume")
        if not resume:
            return
        if dist.get_rank() == 0:
            folder = Path("checkpoint") / f"step-{step}"
            shutil.copytree(self.dumps[resume] / folder, self.dump / folder)
        dist.barrier()


def run_layouts(train: Callable[[Layout], dict], argv: Sequence[str] | None = None) -> None:
    """The rank side: ``train`` each layout of SPEC in turn; rank 0 writes ``{name: record}`` to OUT.

    ``argv`` is ``[SPEC, OUT]`` (the command line's by default). Each layout's dump folder is ``runI``
    beside OUT, I its place in the spec.
    """
    import torch.distributed as dist

    from torchtitan.distributed.lifecycle import shutdown_distributed
    from torchtitan.logging_setup import init_logger

    spec_path, out_path = argv if argv is not None else sys.argv[1:]
    init_logger()
    spec = json.loads(Path(spec_path).read_text())
    root = Path(out_path).parent
    dumps = {name: root / f"run{i}" for i, name in enumerate(spec["layouts"])}
    records: dict[str, dict] = {}
    for name, layout in spec["layouts"].items():
        start = time.monotonic()
        records[name] = train(Layout(name, [*spec["common"], *layout["overrides"]], dumps[name], layout, dumps))
        if dist.get_rank() == 0:  # shown with the failure if a later layout hangs
            print(f"{Path(sys.argv[0]).stem}: {name}: {time.monotonic() - start:.0f}s", file=sys.stderr, flush=True)
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(records))
    shutdown_distributed(ok=True, timeout_seconds=120)  # the trainer's ending: no gloo group left to the exit


def launch(entry: Path, root: Path, common: list[str], layouts: dict[str, dict], *, nproc: int, timeout: float,
           env: dict[str, str] | None = None) -> dict:
    """The test side: run ``entry`` on ``nproc`` ranks over ``layouts`` (``{name: {"overrides": [...], ...}}``),
    with ``common`` before each layout's overrides, and return what its rank 0 wrote.

    ``root`` is an empty folder for the spec, the result and the dump folders; ``env`` adds to the launch's
    environment. A failed launch fails the test with the end of its output.
    """
    # conftest is the test suite's, on the path of pytest but not of the ranks, which import this module too.
    from conftest import run_torchrun

    spec, out = root / "spec.json", root / "out.json"
    spec.write_text(json.dumps({"common": common, "layouts": layouts}))
    done = run_torchrun(entry, str(spec), str(out), nproc=nproc, timeout=timeout, env=env)
    assert done.returncode == 0, done.stderr[-8000:]
    return json.loads(out.read_text())
