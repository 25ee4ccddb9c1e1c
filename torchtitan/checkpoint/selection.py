"""Which checkpoint a run loads, decided from the checkpoint folder alone.

Every rank runs this on its own (``torchtitan/preflight.py`` first, then the
checkpoint manager): it reads only the folder, so a missing step, a corrupt
checkpoint or one that does not fit the model fails on every rank alike with one
clear line each, and nobody waits in a collective.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from torchtitan.checkpoint.location import Location, is_remote, location
from torchtitan.checkpoint.store import Listing, scan, verify
from torchtitan.config.job_config import Checkpoint


def checkpoint_folder(ck: Checkpoint, dump_folder: str) -> Location:
    """``<dump_folder>/<checkpoint.folder>``, or ``checkpoint.folder`` itself when it is an object-store URI."""
    if is_remote(ck.folder):
        return location(ck.folder)
    return Path(dump_folder) / ck.folder


def model_shapes(model_factory: Callable[[], torch.nn.Module]) -> dict[str, tuple[int, ...]]:
    """FQN -> shape of every tensor the model's checkpoint holds (parameters and persistent buffers, such as
    an MoE router's bias) for the model the config describes (built on the meta device: no memory)."""
    with torch.device("meta"):
        model = model_factory()
    # Every name a state dict holds: a tied weight is saved under both of its names.
    return {fqn: tuple(t.shape) for fqn, t in model.state_dict(keep_vars=True).items()}


def choose_checkpoint(
    ck: Checkpoint, folder: Location, listing: Listing, expected_shapes: dict[str, tuple[int, ...]] | None
) -> tuple[Location | None, dict[str, Any], list[str]]:
    """The committed checkpoint this run loads (None: start from scratch), its manifest, and problems.

    ``listing``: what the caller's ``scan(folder)`` found; the caller reads it too (the leftovers it warns of,
    whether there is a checkpoint to fit the model to), so the folder, an object store's included, is listed once.
    """
    complete = ", ".join(str(s) for s in sorted(listing.committed)) or "none"
    if ck.load_step >= 0:
        if ck.load_step not in listing.committed:
            leftovers = listing.partial.get(ck.load_step)
            why = (f"only an incomplete save ({leftovers[0].name}) exists" if leftovers
                   else "there is no such checkpoint")
            return None, {}, [f"--checkpoint.load_step={ck.load_step}: {why} in {folder} (complete steps: {complete}); "
                              "use -1 for the latest complete one"]
        step = ck.load_step
    else:
        step = listing.latest()
        if step is None:
            return None, {}, []
    path = listing.committed[step]
    check_model = "model" not in ck.exclude_from_loading
    problems, manifest = verify(path, expected_shapes if check_model else None)
    if problems:
        others = ", ".join(str(s) for s in sorted(listing.committed) if s != step) or "none"
        problems.append(f"nothing was deleted; to load another complete checkpoint pass --checkpoint.load_step=<step> "
                        f"(other steps in {folder}: {others}), or move {path.name} away")
    return path, manifest, problems


def leftover_warnings(listing: Listing, folder: Location, chosen: Location | None) -> list[str]:
    """One WARNING line per incomplete save in ``listing`` (``step-N.tmp``, or an object store's ``step-N/``
    without a manifest), which no run loads; ``chosen``: the checkpoint this run loads (None: none).

    With nothing committed yet the run starts from step 0, and the line names the leftover's step and
    what to do: another job still writing it shares the folder with this one; an interrupted save is lost.
    """
    lines = []
    for step, leftovers in sorted(listing.partial.items()):
        for leftover in leftovers:
            if chosen is not None:
                lines.append(f"Checkpoint: skipping {leftover}: an incomplete save (interrupted or still being "
                             f"written); loading {chosen} instead")
            else:
                lines.append(f"Checkpoint: {folder} holds no complete checkpoint, only an incomplete save of step "
                             f"{step} ({leftover}), which cannot be loaded: this run starts from step 0; if another "
                             "job is still writing it, stop this one or give it another --checkpoint.folder, else "
                             "that save was interrupted and the leftover can be deleted")
    return lines


def own_checkpoint_exists(ck: Checkpoint, dump_folder: str) -> bool:
    """True when the run resumes from its own checkpoint (which wins over ``initial_load_path``)."""
    return ck.enable_checkpoint and bool(scan(checkpoint_folder(ck, dump_folder)).committed)
