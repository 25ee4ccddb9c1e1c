"""Train several layouts in one launch: the spec, the rank side's loop and the test side's launch.

A test calls ``launch(entry, root, common, layouts, nproc=...)``: it writes the spec ``{"common":
[overrides], "layouts": {name: {"overrides": [...], ...}}}`` under ``root`` and runs the entry
script's ``train`` on ``nproc`` ranks forked from the test session's preloaded forkserver
(tests/dist_harness.py), which spares each rank the seconds of importing torch and the trainer that a
torchrun start pays. Every rank trains each layout in turn, in spec order, in the one default group
(``run_layouts``), and rank 0 writes ``{name: train(layout)}`` to OUT, which ``launch`` returns. What a
run records is the entry's own, and so is any key of a layout other than ``overrides``.

An entry also runs under torchrun by hand (``torchrun --nproc_per_node N ENTRY SPEC OUT``), the same loop.
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
            print(f"{Path(spec_path).parent.name}: {name}: {time.monotonic() - start:.0f}s", file=sys.stderr,
                  flush=True)
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(records))
    shutdown_distributed(ok=True, timeout_seconds=120)  # the trainer's ending: no gloo group left to the exit


def _rank_main(rank: int, world_size: int, entry: str, spec: str, out: str) -> None:
    """A forked rank: ``run_layouts`` with the ``train`` of the entry script at path ``entry``."""
    import importlib.util

    module_spec = importlib.util.spec_from_file_location(Path(entry).stem, entry)
    assert module_spec is not None and module_spec.loader is not None, entry
    module = importlib.util.module_from_spec(module_spec)
    sys.path.insert(0, str(Path(entry).parent))  # the entry's own imports, as when it runs as a script
    module_spec.loader.exec_module(module)
    run_layouts(module.train, [spec, out])


def launch(entry: Path, root: Path, common: list[str], layouts: dict[str, dict], *, nproc: int, timeout: float,
           env: dict[str, str] | None = None) -> dict:
    """The test side: run ``entry``'s ``train`` on ``nproc`` ranks over ``layouts`` (``{name: {"overrides":
    [...], ...}}``), with ``common`` before each layout's overrides, and return what its rank 0 wrote.

    ``root`` is an empty folder for the spec, the result and the dump folders; ``env`` adds to the ranks'
    environment. A rank that fails fails the test with its traceback; ``timeout`` bounds the wait for
    each rank's end.
    """
    # dist_harness is the test suite's, on the path of pytest but not of a torchrun-started entry, which
    # imports this module too.
    from dist_harness import run_ranks

    spec, out = root / "spec.json", root / "out.json"
    spec.write_text(json.dumps({"common": common, "layouts": layouts}))
    # The default group's timeout before the trainer sets its own: a first step on 8 ranks sharing 2 cores
    # (or compiling) keeps a rank out of collectives for minutes.
    run_ranks(_rank_main, nproc, str(entry), str(spec), str(out), timeout=timeout, collective_timeout=900,
              env={"OMP_NUM_THREADS": "1", **(env or {})}, log_dir=str(root))
    return json.loads(out.read_text())
