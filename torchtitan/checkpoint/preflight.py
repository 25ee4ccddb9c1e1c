"""Checkpoint options and the checkpoint to load, checked before any process group exists.

Every rank runs this on its own: it reads only the checkpoint folder, so a missing
step, a corrupt checkpoint or one that does not fit the model config fails on every
rank alike with one clear line each, and nobody waits in a collective.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from torchtitan.checkpoint.store import STATE_KEYS, scan, verify


def checkpoint_folder(cfg) -> Path:
    return Path(cfg.job.dump_folder) / cfg.checkpoint.folder


def model_shapes(model_factory: Callable[[], torch.nn.Module]) -> dict[str, tuple[int, ...]]:
    """Parameter FQN -> shape of the model the config describes (built on the meta device: no memory)."""
    with torch.device("meta"):
        model = model_factory()
    return {fqn: tuple(p.shape) for fqn, p in model.named_parameters()}


def choose_checkpoint(
    cfg, expected_shapes: dict[str, tuple[int, ...]] | None
) -> tuple[Path | None, dict[str, Any], list[str]]:
    """The committed checkpoint this run loads (None: start from scratch), its manifest, and problems."""
    ck, folder = cfg.checkpoint, checkpoint_folder(cfg)
    listing = scan(folder)
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


def check_checkpoint_config(cfg, world_size: int, model_factory: Callable[[], torch.nn.Module],
                            model_args=None) -> list[str]:
    """One line per problem with the ``[checkpoint]`` options or the checkpoint they select.

    ``model_args`` (the configured ``ModelArgs``) lets ``initial_load_path`` be checked
    against the model; it is checked only when the run has no checkpoint of its own,
    since that one wins.
    """
    ck = cfg.checkpoint
    problems = _check_initial_load(cfg, model_args) if model_args is not None else []
    unknown = [k for k in ck.exclude_from_loading if k not in STATE_KEYS]
    if unknown:
        problems.append(f"--checkpoint.exclude_from_loading: unknown state(s) {', '.join(unknown)}; "
                        f"choose from {', '.join(STATE_KEYS)}")
    if ck.load_step < -1:
        problems.append(f"--checkpoint.load_step={ck.load_step}: use a step >= 0, or -1 for the latest checkpoint")
    if ck.create_seed_checkpoint:
        if world_size != 1:
            problems.append(f"--checkpoint.create_seed_checkpoint runs on one process, but WORLD_SIZE={world_size}; "
                            "run scripts/create_seed_checkpoint.sh (or python train.py without torchrun)")
        existing = scan(checkpoint_folder(cfg)).committed
        if existing:
            problems.append(f"--checkpoint.create_seed_checkpoint: {checkpoint_folder(cfg)} already holds checkpoints "
                            f"(steps {', '.join(map(str, sorted(existing)))}); a seed checkpoint goes into an empty "
                            "folder: choose another --checkpoint.folder or --job.dump_folder")
        return problems
    if ck.enable_checkpoint and not problems:
        listing = scan(checkpoint_folder(cfg))
        shapes = model_shapes(model_factory) if listing.committed else None
        problems += choose_checkpoint(cfg, shapes)[2]
    return problems


def own_checkpoint_exists(cfg) -> bool:
    """True when the run resumes from its own checkpoint (which wins over ``initial_load_path``)."""
    return cfg.checkpoint.enable_checkpoint and bool(scan(checkpoint_folder(cfg)).committed)


def _check_initial_load(cfg, model_args) -> list[str]:
    ck = cfg.checkpoint
    if not ck.initial_load_path or ck.create_seed_checkpoint or own_checkpoint_exists(cfg):
        return []
    from torchtitan.checkpoint.formats import check_source

    return check_source(ck.initial_load_path, ck.initial_load_format, model_args)
