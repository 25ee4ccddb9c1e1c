"""Save and load training state with ``torch.distributed.checkpoint`` (DCP).

What a full checkpoint holds (top-level keys of the DCP state dict):

- ``model``: every parameter under its original FQN, as this layout holds it (DTensor
  shards under FSDP/HSDP/DDP/TP, plain tensors on one process). DCP records global
  shapes, so any other layout can load it: that is the resharding resume.
- ``optimizer``: ``get_optimizer_state_dict``'s flattened form (one key per parameter
  and state), sharded like the model.
- ``lr_scheduler``: the scheduler's state, pickled (a few numbers; identical on all ranks).
- ``dataloader``: the *global* position of the sample stream (epoch, next window),
  which is the same on every rank and independent of the DP degree; see
  ``torchtitan/datasets/loaders.py``. A run with another DP degree continues the
  same global stream from there.
- ``train_state``: the step.
- ``rng``: each rank's Python/NumPy/torch generator states, under ``rank<r>``. They are
  restored only when the layout is unchanged; with another layout ranks do not
  correspond, and every rank keeps the seed that ``training.seed`` gave it.
- the ``extra_states`` given to the constructor (``semi_sync``: DiLoCo's reference parameters, outer
  momentum and counters), each under its name; a run without that state skips it on load.

A ``weights_only`` checkpoint (the final save with ``model_weights_only``) holds
``model`` alone, cast to ``export_dtype``; a ``seed`` checkpoint holds the initialized
``model`` at step 0. How folders are committed and validated: ``store.py``.
"""

from __future__ import annotations

import logging
import pickle
import random
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from torchtitan.checkpoint import integrity, space
from torchtitan.checkpoint.preemption import PreemptionWatch
from torchtitan.checkpoint.selection import checkpoint_folder, choose_checkpoint
from torchtitan.checkpoint.stage_view import model_view
from torchtitan.checkpoint.store import CheckpointKind, commit, purge, read_dcp_metadata, scan, tmp_dir, verify
from torchtitan.config.dtypes import DTYPES
from torchtitan.distributed.parallel_dims import same_layout

logger = logging.getLogger(__name__)

# Optimizer state keyed per parameter ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr"). The
# nested form keeps each param group as one list of FQNs, which differs between pipeline
# ranks under one key; DCP would keep only one rank's list and the others could not load.
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _rng_state() -> bytes:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return pickle.dumps(state)


def _set_rng_state(blob: bytes) -> None:
    state = pickle.loads(blob)
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _always() -> bool:
    return True


@dataclass
class _PendingSave:
    step: int
    kind: str
    future: Future
    started: float
    writer: dcp.FileSystemWriter
    needed: int


class CheckpointManager:
    """Loads at start, saves every ``interval`` steps and at the end, and on SIGTERM.

    The trainer calls ``load()`` before its first step (returns the step to resume
    after), ``maybe_save(step)`` after every step (returns True when the run was
    preempted and must stop now), ``save_seed()`` for a seed checkpoint, and
    ``close()`` before exit (waits for an async save). Every method is called on
    every rank.
    """

    def __init__(self, cfg, *, model_parts: list[torch.nn.Module], optimizer: torch.optim.Optimizer,
                 lr_scheduler: torch.optim.lr_scheduler.LRScheduler, dataloader, dims, rank: int,
                 model_args=None, writes: Callable[[], bool] | None = None,
                 extra_states: dict[str, Any] | None = None) -> None:
        ck = cfg.checkpoint
        self.cfg, self.ck = cfg, ck
        self.enabled = ck.enable_checkpoint
        self.model_args = model_args  # for initial_load_path (name and layout mapping)
        self.initial_load = bool(ck.initial_load_path) and not ck.create_seed_checkpoint
        self.active = ck.enable_checkpoint or ck.create_seed_checkpoint or self.initial_load
        self.folder = checkpoint_folder(cfg)
        self.total_steps = cfg.training.steps
        self.model_parts, self.optimizer, self.lr_scheduler = model_parts, optimizer, lr_scheduler
        self.dataset = dataloader.dataset  # the position lives in the dataset; see the module docstring
        self.rank = rank
        self.layout = dims.layout()
        self.loaded_step: int | None = None
        self._pending: _PendingSave | None = None
        self.preemption = PreemptionWatch(ck.preemption_check_steps)
        self._closed = False
        self.pg: dist.ProcessGroup | None = None
        # Fault tolerance: one live replica group writes the job's checkpoints (``writes`` says whether
        # this one does, per save), each group into a temporary folder of its own.
        ft = cfg.fault_tolerance
        self.tmp_tag = f"-group{ft.replica_id}" if ft.enable else ""
        self.writes: Callable[[], bool] = writes or _always
        # name -> object with state_dict()/load_state_dict(), saved in full checkpoints and loaded back (DCP in place)
        self.extra: dict[str, Any] = dict(extra_states or {})
        if not self.active:
            return
        self._view = model_view(model_parts)
        if dist.is_initialized():
            # A gloo group of its own: an async save runs its collectives in a background
            # thread, which must never interleave with the training thread's collectives on
            # a shared group; gloo also carries DCP's CPU-side coordination under NCCL.
            timeout = timedelta(seconds=max(cfg.comm.init_timeout_seconds, 1800))
            self.pg = dist.new_group(backend="gloo", timeout=timeout)
        if self.enabled:
            self.preemption.install()

    # ---- the state -------------------------------------------------------------
    def _model_state(self) -> dict[str, Any]:
        return get_model_state_dict(self._view)

    def _full_state(self, step: int) -> dict[str, Any]:
        return {
            "model": self._model_state(),
            "optimizer": get_optimizer_state_dict(self._view, self.optimizer, options=_OPTIM_OPTIONS),
            # Pickled into one value: DCP would otherwise flatten its nested lists and dicts.
            "lr_scheduler": pickle.dumps(self.lr_scheduler.state_dict()),
            "dataloader": self.dataset.state_dict(),
            "train_state": {"step": step},
            "rng": {f"rank{self.rank}": _rng_state()},
            **{name: stateful.state_dict() for name, stateful in self.extra.items()},
        }

    def _weights_state(self) -> dict[str, Any]:
        dtype = DTYPES[self.ck.export_dtype]
        model = {k: v.detach().to(dtype) if v.is_floating_point() else v for k, v in self._model_state().items()}
        return {"model": model}

    # ---- saving ----------------------------------------------------------------
    def _barrier(self) -> None:
        if self.pg is not None:
            dist.barrier(group=self.pg)

    def _write(self, step: int, kind: str, state: dict[str, Any], sync: bool) -> None:
        self._finish_pending()
        tmp = tmp_dir(self.folder, step, self.tmp_tag)
        if self.rank == 0 and tmp.exists():
            # An earlier attempt at this step was interrupted; it was never visible.
            shutil.rmtree(tmp)
        self._barrier()  # nobody measures the free space, nor creates files in tmp, before rank 0 cleared it
        needed = self._check_space(step, kind, state)
        writer = integrity.ChecksummingWriter(str(tmp)) if self.ck.checksums else dcp.FileSystemWriter(str(tmp))
        started = time.monotonic()
        if sync:
            try:
                dcp.save(state, storage_writer=writer, process_group=self.pg)
            except BaseException as e:  # DCP's CheckpointException is a BaseException
                self._raise_if_disk_full(e, step, needed, together=True)
                raise
            self._commit(step, kind, started, writer)
        else:
            response = dcp.async_save(state, storage_writer=writer, process_group=self.pg)
            # torch returns a Future, or with custom staging a response holding one.
            future = getattr(response, "upload_completion", response)
            self._pending = _PendingSave(step, kind, future, started, writer, needed)
            if self.rank == 0:
                logger.info("Checkpoint step %d: async save started (staged in %.2fs)", step,
                            time.monotonic() - started)

    def _check_space(self, step: int, kind: str, state: dict[str, Any]) -> int:
        """Before any write: the bytes this save needs; DiskFullError on every rank when any rank lacks them.

        The ranks agree (one gather of each one's free space and state sizes) because their
        measures of a shared file system may differ by what others wrote meanwhile, and a
        rank that raised alone would leave the others waiting in DCP's collectives; the
        union of the state sizes is also the whole save's under pipeline parallelism.
        """
        previous = space.previous_size(self.folder, kind)
        sizes = {} if previous else space.state_sizes(state)
        outcomes = self._gather((space.free_bytes(self.folder), sizes))
        merged = {key: size for _, sizes_of_rank in outcomes for key, size in sizes_of_rank.items()}
        needed = previous or sum(merged.values())
        free = min(free_of_rank for free_of_rank, _ in outcomes)
        if free < needed:
            raise space.DiskFullError(space.disk_full_line(self.folder, step, needed, free, midway=False))
        return needed

    def _raise_if_disk_full(self, error: BaseException, step: int, needed: int, together: bool = False) -> None:
        """A save that failed with ENOSPC/EDQUOT (DCP shares each rank's error with all): remove it, name it.

        ``together``: every rank is here (a synchronous save, which DCP failed on every rank at
        once, or an async one met at the next save or at close); the ranks then measure the free
        space after the removal, and print the same line.
        """
        if not space.is_disk_full(error):
            return
        tmp = tmp_dir(self.folder, step, self.tmp_tag)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # every rank is past its writes: DCP failed them together
        if together:
            self._barrier()
        raise space.DiskFullError(space.disk_full_line(self.folder, step, needed, space.free_bytes(self.folder),
                                                       midway=True)) from None

    def _commit(self, step: int, kind: str, started: float, writer: dcp.FileSystemWriter) -> None:
        # DCP's save returns on rank 0 only after every rank reported its writes and the
        # global metadata is written, so rank 0 alone can make the checkpoint visible.
        if self.rank != 0:
            return
        manifest = {"kind": kind, "states": self._states_of(kind) + ([] if kind in CheckpointKind.MODEL_ONLY
                                                                     else sorted(self.extra)), "layout": self.layout,
                    "dtype": self.ck.export_dtype if kind == CheckpointKind.WEIGHTS_ONLY else "as trained",
                    "torch_version": torch.__version__}
        if isinstance(writer, integrity.ChecksummingWriter):
            tmp = tmp_dir(self.folder, step, self.tmp_tag)
            manifest["checksums"] = integrity.collect(tmp, writer.metadata_checksum())
        path = commit(self.folder, step, manifest, self.tmp_tag)
        logger.info("Checkpoint step %d saved to %s (%s, %.2fs)", step, path, kind, time.monotonic() - started)
        # Never the checkpoint this run loaded, nor the one just written (an older run may have left higher steps).
        protected = {step} | ({self.loaded_step} if self.loaded_step is not None else set())
        for gone in purge(self.folder, self.ck.keep_latest_k, protected):
            logger.info("Checkpoint: deleted %s (keep_latest_k=%d)", gone, self.ck.keep_latest_k)

    @staticmethod
    def _states_of(kind: str) -> list[str]:
        return ["model"] if kind in CheckpointKind.MODEL_ONLY else \
            ["dataloader", "lr_scheduler", "model", "optimizer", "rng", "train_state"]

    def _finish_pending(self, block: bool = True, together: bool = True) -> None:
        """Commit a finished async save; ``block`` waits for it, else only a successful one is taken.

        A failed save is left pending until a blocking call, which every rank makes at the same
        point (the next save, or ``close``): the ranks see a failure at different steps, and one
        that stopped alone would leave the others waiting in a collective, its line unprinted by
        them. ``together``: every rank is here (``close`` after a failure on this rank is not).
        """
        pending = self._pending
        if pending is None or (not block and not (pending.future.done() and pending.future.exception() is None)):
            return
        self._pending = None
        try:
            pending.future.result()  # re-raises a failed save on this rank
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            self._raise_if_disk_full(e, pending.step, pending.needed, together=together)
            raise
        self._commit(pending.step, pending.kind, pending.started, pending.writer)

    def save(self, step: int, *, kind: str = CheckpointKind.FULL, sync: bool = True) -> None:
        """Write a checkpoint of the current state (a collective: every rank calls it)."""
        state = self._weights_state() if kind == CheckpointKind.WEIGHTS_ONLY else self._full_state(step)
        self._write(step, kind, state, sync)

    def save_seed(self) -> None:
        """Write the freshly initialized model as step 0, for any layout to start from."""
        self._write(0, CheckpointKind.SEED, {"model": self._model_state()}, sync=True)

    def may_save(self, step: int) -> bool:
        """Whether ``maybe_save(step)`` may write a checkpoint: the last step, an interval, a preemption check.

        The trainer reads (and checks) the step's loss first on these steps, so no checkpoint of
        a diverged model is written.
        """
        return self.enabled and (step >= self.total_steps or step % self.ck.interval == 0
                                 or self.preemption.due(step))

    def maybe_save(self, step: int) -> bool:
        """After each step: save when due; True when the job was preempted and has to stop now."""
        if not self.enabled:
            return False
        self._finish_pending(block=False)  # make a finished async save visible early
        preempted = self.preemption.due(step) and self.preemption.agreed()
        if not self.writes():  # another replica group writes this job's checkpoints
            return preempted
        if step >= self.total_steps:
            kind = CheckpointKind.WEIGHTS_ONLY if self.ck.model_weights_only else CheckpointKind.FULL
            self.save(step, kind=kind, sync=True)
        elif preempted:
            self.save(step, kind=CheckpointKind.FULL, sync=True)
            if self.rank == 0:
                logger.warning("Preempted: checkpoint of step %d saved; stopping", step)
            return True
        elif step % self.ck.interval == 0:
            self.save(step, kind=CheckpointKind.FULL, sync=self.ck.async_mode != "async")
        return False

    def close(self, wait_for_peers: bool = True) -> None:
        """Wait for an async save and commit it; then every rank knows the last checkpoint is visible.

        ``wait_for_peers=False`` (this rank failed) still waits for the pending save, which
        the checkpoint group's timeout bounds, but skips the barrier that the other ranks,
        stuck elsewhere, would never reach.
        """
        if self._closed or not self.active:
            return
        self._closed = True
        try:
            self._finish_pending(together=wait_for_peers)
            if wait_for_peers:
                self._barrier()
        finally:
            self.preemption.uninstall()

    # ---- loading ---------------------------------------------------------------
    def load(self) -> int:
        """Load the chosen checkpoint (if any); return the step to continue after (0: from scratch).

        Without a checkpoint of its own the run starts from ``initial_load_path`` when set.

        A failure on one rank (the folder changed since preflight, a damaged file, a state
        that does not fit) becomes the same error on every rank: each phase ends with the
        ranks agreeing on whether someone failed (``_agree``), so no rank raises while the
        others wait in a collective it will never join.
        """
        if self.ck.create_seed_checkpoint:
            return 0
        if not self.enabled:
            self._load_initial()
            return 0
        self._warn_if_folder_small()
        path, manifest = self._choose()
        if path is None:
            if self.initial_load:
                self._load_initial()
            elif self.rank == 0:
                logger.info("Checkpoint: no checkpoint in %s; training from scratch", self.folder)
            return 0
        if self.initial_load and self.rank == 0:
            logger.info("Checkpoint: %s holds this run's own checkpoint, which wins: --checkpoint.initial_load_path="
                        "%s is not loaded", self.folder, self.ck.initial_load_path)
        started = time.monotonic()
        path, manifest, wanted, state = self._verified(path, manifest)
        step = int(manifest["step"])
        self._read_and_apply(path, state)
        self.loaded_step = step
        resumed = step if "train_state" in wanted else 0
        if self.rank == 0:
            logger.info("Checkpoint: loaded %s (%s: %s) in %.2fs; continuing after step %d", path,
                        manifest["kind"], ", ".join(wanted), time.monotonic() - started, resumed)
        return resumed

    def _choose(self) -> tuple[Path | None, dict[str, Any]]:
        """The checkpoint to resume from (None: none), chosen alike on every rank; warns of interrupted saves."""
        try:
            listing = scan(self.folder)
            path, manifest, problems = choose_checkpoint(self.cfg, None)
            error = "; ".join(problems) if problems else None  # preflight checked this; the folder changed since
        except Exception as e:  # noqa: BLE001 - shared with the other ranks below, then raised
            path, manifest, error = None, {}, f"{type(e).__name__}: {e}"
        self._agree(error, "choosing the checkpoint", choice=None if path is None else path.name)
        if path is not None and self.rank == 0:
            for _step, leftovers in sorted(listing.partial.items()):
                for leftover in leftovers:
                    logger.warning("Checkpoint: skipping %s: an incomplete save (interrupted or still being "
                                   "written)", leftover)
        return path, manifest

    def _states_to_load(self, manifest: dict[str, Any], path: Path) -> list[str]:
        """The checkpoint's states this run takes: not the excluded ones, nor the RNG states of another layout."""
        if manifest["kind"] != CheckpointKind.FULL and self.rank == 0:
            logger.warning("Checkpoint %s is a %s checkpoint: it holds the model only, so the optimizer, LR "
                           "schedule and data start fresh at step 0", path, manifest["kind"].replace("_", "-"))
        wanted = [k for k in manifest["states"] if k not in self.ck.exclude_from_loading]
        for k in [k for k in wanted if k not in self._states_of(CheckpointKind.FULL) and k not in self.extra]:
            wanted.remove(k)  # e.g. DiLoCo's state, read by a run that does not use DiLoCo
            if self.rank == 0:
                logger.info("Checkpoint: %s holds '%s', which this run does not use; not loaded", path, k)
        if "rng" in wanted and not same_layout(manifest.get("layout"), self.layout):
            wanted.remove("rng")
            if self.rank == 0:
                logger.info("Checkpoint: layout changed (%s -> %s); RNG states are per rank and not restored",
                            manifest.get("layout"), self.layout)
        return wanted

    def _warn_if_folder_small(self) -> None:
        """At start (rank 0): warn when the folder cannot hold ``keep_latest_k`` + 1 full checkpoints.

        The size is the newest full checkpoint's, or else the weights and AdamW's two moments
        (three times the model's bytes): the optimizer state does not exist yet, and building
        it only to measure it would change the run.
        """
        if self.rank != 0:
            return
        # DTensors count their global sizes; a pipeline stage holds about 1/pp of the layers.
        weights = self.layout["pp"] * sum(p.numel() * p.element_size() for p in self._view.parameters())
        size = space.previous_size(self.folder, CheckpointKind.FULL) or 3 * weights
        warning = space.room_warning(self.folder, self.ck.keep_latest_k, size)
        if warning:
            logger.warning("%s", warning)

    # ---- verifying before loading ------------------------------------------------
    def _verified(self, path: Path, manifest: dict[str, Any]) -> tuple[Path, dict[str, Any], list[str], dict]:
        """The checkpoint to load, its manifest, the states wanted and their template, after the checksums.

        Each rank hashes the files its own load will read; one gather per candidate then
        gives every rank every bad file, so all log the same lines and take the same
        next candidate: the collectives stay in step whatever any rank found. With an
        explicit ``load_step`` a bad file ends the job; otherwise the newest earlier
        checkpoint that verifies loads. Nothing is read into the model before a
        candidate verified on every rank.
        """
        explicit = self.ck.load_step >= 0
        candidates = [path] + ([] if explicit else [
            p for s, p in sorted(scan(self.folder).committed.items(), reverse=True) if s < int(manifest["step"])])
        for candidate in candidates:
            error, bad, wanted, state = None, [], [], {}
            try:
                if candidate is not path:
                    bad, manifest = verify(candidate, None)  # preflight checked only the first candidate
                bad = bad or self._bad_files(candidate, manifest, None)  # .metadata, before it is unpickled
                if not bad:
                    wanted = self._states_to_load(manifest, candidate)
                    state = self._load_template(wanted, candidate)
                    bad = self._bad_files(candidate, manifest, state)
            except Exception as e:  # noqa: BLE001 - shared with the other ranks below, then raised
                error = f"{type(e).__name__}: {e}"
            outcomes = self._gather((error, bad, candidate.name))
            self._raise_failures([o[0] for o in outcomes], f"verifying {candidate}")
            if len({o[2] for o in outcomes}) != 1:
                raise RuntimeError(f"ranks see different checkpoints in {self.folder}: {[o[2] for o in outcomes]}; "
                                   "the checkpoint folder must be one shared file system path")
            every_bad = sorted({line for o in outcomes for line in o[1]})
            if not every_bad:
                return candidate, manifest, wanted, state
            for line in every_bad:  # on every rank: a rank's log alone tells what happened
                logger.error("%s", line)
            if explicit:
                raise RuntimeError(f"--checkpoint.load_step={self.ck.load_step}: {every_bad[0]}; nothing was loaded "
                                   "or deleted: pass another step, or -1 for the newest checkpoint that verifies")
            logger.warning("Checkpoint: %s does not verify; trying the newest earlier checkpoint", candidate)
        raise RuntimeError(f"checkpoint: no checkpoint in {self.folder} verifies (see the lines above); nothing was "
                           "loaded or deleted: move the damaged ones away to start from scratch")

    def _bad_files(self, path: Path, manifest: dict[str, Any], state: dict[str, Any] | None) -> list[str]:
        """Lines naming the files this rank reads (``.metadata`` alone when ``state`` is None) that fail their check."""
        checksums = manifest.get("checksums")
        if not self.ck.checksums:
            return []
        if checksums is None:
            if state is None and self.rank == 0:
                logger.warning("Checkpoint: %s was written without checksums (before they were recorded, or with "
                               "--checkpoint.checksums=false); it loads unverified", path)
            return []
        if state is None:
            return integrity.bad_files(path, checksums, {integrity.DCP_METADATA})
        names = integrity.files_read(state, read_dcp_metadata(path)) - {integrity.DCP_METADATA}
        return integrity.bad_files(path, checksums, names)

    def _gather(self, item: Any) -> list[Any]:
        if self.pg is None or dist.get_world_size(self.pg) == 1:
            return [item]
        outcomes: list[Any] = [None] * dist.get_world_size(self.pg)
        dist.all_gather_object(outcomes, item, group=self.pg)
        return outcomes

    def _raise_failures(self, errors: list[str | None], doing: str) -> None:
        failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
        if failed:
            raise RuntimeError(f"checkpoint: {doing} failed on {len(failed)} of {len(errors)} ranks (nothing was "
                               f"deleted): " + " | ".join(failed))

    def _read_and_apply(self, path: Path, state: dict[str, Any]) -> None:
        """Read ``state``'s entries from ``path`` into this layout, then set them; a failure on any rank fails all."""
        error = None
        try:
            dcp.load(state, checkpoint_id=str(path), process_group=self.pg)
        except Exception as e:  # noqa: BLE001 - shared with the other ranks below, then raised
            error = f"{type(e).__name__}: {e}"
        self._agree(error, f"loading {path}")
        try:
            self._apply(state)
        except Exception as e:  # noqa: BLE001 - shared with the other ranks below, then raised
            error = f"{type(e).__name__}: {e}"
        self._agree(error, f"applying {path}")

    def _load_initial(self) -> None:
        """Start from ``initial_load_path`` (checked in preflight): each rank reads what it holds."""
        if not self.initial_load:
            return
        from torchtitan.checkpoint.formats import load_into

        started, n, error = time.monotonic(), 0, None
        try:
            n = load_into(self._view, self.ck.initial_load_path, self.ck.initial_load_format, self.model_args,
                          process_group=self.pg)
        except Exception as e:  # noqa: BLE001 - shared with the other ranks, then raised on every rank
            error = f"{type(e).__name__}: {e}"
        self._agree(error, f"loading {self.ck.initial_load_path}")
        if self.rank == 0:
            logger.info("Checkpoint: no checkpoint of this run; loaded %d tensors from %s (%s format) in %.2fs; "
                        "training starts from them at step 0", n, self.ck.initial_load_path,
                        self.ck.initial_load_format, time.monotonic() - started)

    def _agree(self, error: str | None, doing: str, choice: str | None | bool = False) -> None:
        """Every rank raises if any rank failed at ``doing``, with the failing ranks' own messages.

        With a ``choice`` (a checkpoint name, or None for none), the ranks must also have
        chosen the same checkpoint (a shared folder seen alike).
        """
        if self.pg is None or dist.get_world_size(self.pg) == 1:
            if error is not None:
                raise RuntimeError(f"checkpoint: {doing} failed (nothing was deleted): {error}")
            return
        world = dist.get_world_size(self.pg)
        outcomes: list[Any] = [None] * world
        dist.all_gather_object(outcomes, (error, choice), group=self.pg)
        failed = [f"rank {r}: {e}" for r, (e, _) in enumerate(outcomes) if e is not None]
        if failed:
            raise RuntimeError(f"checkpoint: {doing} failed on {len(failed)} of {world} ranks (nothing was "
                               f"deleted): " + " | ".join(failed))
        choices = [name for _, name in outcomes]
        if choice is not False and len(set(choices)) != 1:
            raise RuntimeError(f"ranks see different checkpoints in {self.folder}: {choices}; the checkpoint "
                               "folder must be one shared file system path")

    def _load_template(self, wanted: list[str], path: Path) -> dict[str, Any]:
        """What to load, shaped like this layout's state (the data position: like the checkpoint's); DCP fills it."""
        state: dict[str, Any] = {}
        if "model" in wanted:
            state["model"] = self._model_state()
        if "optimizer" in wanted:
            # Only when it is loaded: getting it initializes the optimizer's state.
            state["optimizer"] = get_optimizer_state_dict(self._view, self.optimizer, options=_OPTIM_OPTIONS)
        if "lr_scheduler" in wanted:
            state["lr_scheduler"] = b""
        if "dataloader" in wanted:
            state["dataloader"] = _saved_data_position(path)
        if "train_state" in wanted:
            state["train_state"] = {"step": 0}
        if "rng" in wanted:
            state["rng"] = {f"rank{self.rank}": b""}
        for name in self.extra:
            if name in wanted:
                state[name] = self.extra[name].state_dict()
        return state

    def _apply(self, state: dict[str, Any]) -> None:
        if "model" in state:
            set_model_state_dict(self._view, state["model"])
        if "optimizer" in state:
            set_optimizer_state_dict(self._view, self.optimizer, state["optimizer"], options=_OPTIM_OPTIONS)
        if "lr_scheduler" in state:
            self.lr_scheduler.load_state_dict(pickle.loads(state["lr_scheduler"]))
        if "dataloader" in state:
            self.dataset.load_state_dict(state["dataloader"])
        if "rng" in state:
            _set_rng_state(state["rng"][f"rank{self.rank}"])
        for name, stateful in self.extra.items():
            if name in state:
                stateful.load_state_dict(state[name])


def _saved_data_position(path: Path) -> dict[str, Any]:
    """A template of the data position with the checkpoint's keys, not this run's.

    The keys differ between loaders and settings: a held-out split adds one, a
    streamed hub dataset keeps one entry per DP rank. Shaped like the checkpoint, the
    read always succeeds, and the dataset's ``load_state_dict`` then says in its own
    words when the position does not map onto this run (shaped like this run, a
    missing key was DCP's error, and an extra one in the checkpoint went unnoticed).
    """
    template: dict[str, Any] = {}
    for keys in read_dcp_metadata(path).planner_data.values():
        if keys[0] != "dataloader":
            continue
        node = template
        for key in keys[1:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = None
    return template
