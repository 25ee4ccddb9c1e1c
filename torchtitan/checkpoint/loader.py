"""Loading at start: choose the checkpoint, verify its checksums, read it into this layout, set the states.

A failure on one rank (the folder changed since preflight, a damaged file, a state that
does not fit) becomes the same error on every rank: each phase ends with the ranks
agreeing on whether someone failed (``agreement.py``), so no rank raises while the others
wait in a collective it will never join. Nothing is read into the model before a
candidate verified on every rank, and nothing is ever deleted.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch.distributed.checkpoint.state_dict_loader as dcp_loader
from torch.distributed.checkpoint.api import CheckpointException

from torchtitan.checkpoint import integrity, space
from torchtitan.checkpoint.agreement import Agreement
from torchtitan.checkpoint.location import Location
from torchtitan.checkpoint.no_pickle import NoPickleLoadPlanner
from torchtitan.checkpoint.selection import choose_checkpoint, leftover_warnings
from torchtitan.checkpoint.states import StateRegistry
from torchtitan.checkpoint.store import CheckpointKind, Listing, dcp_reader, read_dcp_metadata, scan, verify
from torchtitan.config.job_config import Checkpoint
from torchtitan.config.manager import ConfigError
from torchtitan.distributed.parallel_dims import same_layout

if TYPE_CHECKING:
    from torchtitan.models import DecoderConfig

logger = logging.getLogger(__name__)


def _one_line(error: BaseException) -> str:
    """An error as one line: DCP's exception (a traceback per rank) gives its first rank's error alone."""
    if isinstance(error, CheckpointException) and error.failures:
        first, _trace = next(iter(error.failures.values()))
        error = first
    return f"{type(error).__name__}: {error}"


class Loader:
    """Loads this run's checkpoint, or its ``initial_load_path``; every method is called on every rank."""

    def __init__(self, ck: Checkpoint, folder: Location, states: StateRegistry, agreement: Agreement, *, rank: int,
                 layout: dict[str, int], model_args: DecoderConfig | None = None) -> None:
        self.ck = ck  # the [checkpoint] section
        self.folder, self.states, self.agreement = folder, states, agreement
        self.rank, self.layout = rank, layout
        self.model_args = model_args  # for initial_load_path (name and layout mapping)
        self.initial_load = bool(self.ck.initial_load_path) and not self.ck.create_seed_checkpoint
        self.loaded_step: int | None = None

    def load(self) -> int:
        """Load the chosen checkpoint (if any); return the step to continue after (0: from scratch).

        Without a checkpoint of its own the run starts from ``initial_load_path`` when set.
        """
        if self.ck.create_seed_checkpoint:
            return 0
        if not self.ck.enable_checkpoint:
            self._load_initial()
            return 0
        self._warn_if_folder_small()
        path, manifest, listing = self._choose()
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
        path, manifest, wanted, state = self._verified(path, manifest, listing)
        step = int(manifest["step"])
        self._read_and_apply(path, state)
        self.loaded_step = step
        resumed = self.states.resumed_step(step, wanted)
        if self.rank == 0:
            logger.info("Checkpoint: loaded %s (%s: %s) in %.2fs; continuing after step %d", path,
                        manifest["kind"], ", ".join(wanted), time.monotonic() - started, resumed)
        return resumed

    def _choose(self) -> tuple[Location | None, dict[str, Any], Listing]:
        """The checkpoint to resume from (None: none), chosen alike on every rank, its manifest, and the folder's
        listing it was chosen from (the earlier candidates, should it not verify); warns of interrupted saves."""
        listing = Listing({}, {})
        try:
            listing = scan(self.folder)
            path, manifest, problems = choose_checkpoint(self.ck, self.folder, listing, None)
            error = "; ".join(problems) if problems else None  # preflight checked this; the folder changed since
        except Exception as e:  # noqa: BLE001 - shared with the other ranks below, then raised
            path, manifest, error = None, {}, f"{type(e).__name__}: {e}"
        names = self.agreement.outcomes(error, "choosing the checkpoint", None if path is None else path.name)
        self.agreement.same_checkpoint(names)
        if self.rank == 0:
            for line in leftover_warnings(listing, self.folder, path):
                logger.warning("%s", line)
        return path, manifest, listing

    def _states_to_load(self, manifest: dict[str, Any], path: Location) -> list[str]:
        """The checkpoint's states this run takes: not the excluded ones, nor the RNG states of another layout."""
        if manifest["kind"] != CheckpointKind.FULL and self.rank == 0:
            logger.warning("Checkpoint %s is a %s checkpoint: it holds the model only, so the optimizer, LR "
                           "schedule and data start fresh at step 0", path, manifest["kind"].replace("_", "-"))
        wanted = [k for k in manifest["states"] if k not in self.ck.exclude_from_loading]
        for k in [k for k in wanted if k not in self.states.specs]:
            wanted.remove(k)  # e.g. DiLoCo's state, read by a run that does not use DiLoCo
            if self.rank == 0:
                logger.info("Checkpoint: %s holds '%s', which this run does not use; not loaded", path, k)
        other_layout = not same_layout(manifest.get("layout"), self.layout)
        for k in [k for k in wanted if other_layout and self.states.specs[k].same_layout_only]:
            wanted.remove(k)
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
        model = self.states.holders.model
        weights = self.layout["pp"] * sum(p.numel() * p.element_size() for p in model.parameters())
        size = space.previous_size(self.folder, CheckpointKind.FULL) or 3 * weights
        warning = space.room_warning(self.folder, self.ck.keep_latest_k, size)
        if warning:
            logger.warning("%s", warning)

    def _verified(self, path: Location, manifest: dict[str, Any],
                  listing: Listing) -> tuple[Location, dict[str, Any], list[str], dict]:
        """The checkpoint to load, its manifest, the states wanted and their template, after the checksums.

        Each rank hashes the files its own load will read; one gather per candidate then
        gives every rank every bad file, so all log the same lines and take the same
        next candidate: the collectives stay in step whatever any rank found. With an
        explicit ``load_step`` a bad file ends the job; otherwise the newest earlier
        checkpoint that verifies loads.
        """
        explicit = self.ck.load_step >= 0
        candidates = [path] + ([] if explicit else [
            p for s, p in sorted(listing.committed.items(), reverse=True) if s < int(manifest["step"])])
        for candidate in candidates:
            error, bad, wanted, state = None, [], [], {}
            try:
                if candidate is not path:
                    bad, manifest = verify(candidate, None)  # preflight checked only the first candidate
                bad = bad or self._bad_files(candidate, manifest, None)  # .metadata, before it is unpickled
                if not bad:
                    wanted = self._states_to_load(manifest, candidate)
                    state = self.states.template(wanted, lambda at=candidate: read_dcp_metadata(at))
                    bad = self._bad_files(candidate, manifest, state)
            except Exception as e:  # noqa: BLE001 - shared with the other ranks below, then raised
                error = f"{type(e).__name__}: {e}"
            outcomes = self.agreement.outcomes(error, f"verifying {candidate}", (bad, candidate.name))
            self.agreement.same_checkpoint([name for _, name in outcomes])
            every_bad = sorted({line for bad_of_rank, _ in outcomes for line in bad_of_rank})
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

    def _bad_files(self, path: Location, manifest: dict[str, Any], state: dict[str, Any] | None) -> list[str]:
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

    def _read_and_apply(self, path: Location, state: dict[str, Any]) -> None:
        """Read ``state``'s entries from ``path`` into this layout, then set them; a failure on any rank fails all."""
        error = None
        try:
            # Byte values through the restricted unpickler: a checkpoint from a shared bucket runs no code of its own.
            dcp_loader.load(state, storage_reader=dcp_reader(path), planner=NoPickleLoadPlanner(),
                            process_group=self.agreement.group)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - shared with the other ranks below, then raised
            error = _one_line(e)
        self.agreement.outcomes(error, f"loading {path}", None)
        refusal = None
        try:
            self.states.apply(state)
        except ConfigError as e:
            # A saved position this run's options refuse (another data mixture): the same state and config on
            # every rank give the same refusal, which train.py prints as one line rather than a traceback.
            refusal = e
        except Exception as e:  # noqa: BLE001 - shared with the other ranks below, then raised
            error = f"{type(e).__name__}: {e}"
        self.agreement.outcomes(error, f"applying {path}", None)
        if refusal is not None:
            raise refusal

    def _load_initial(self) -> None:
        """Start from ``initial_load_path`` (checked in preflight): each rank reads what it holds."""
        if not self.initial_load:
            return
        assert self.ck.initial_load_path is not None  # initial_load is set only with a path
        from torchtitan.checkpoint.formats import load_into

        assert self.model_args is not None, "an initial load is set up with the model's args"
        started, n, error = time.monotonic(), 0, None
        try:
            n = load_into(self.states.holders.model, self.ck.initial_load_path, self.ck.initial_load_format,
                          self.model_args, process_group=self.agreement.group)
        except Exception as e:  # noqa: BLE001 - shared with the other ranks, then raised on every rank
            error = f"{type(e).__name__}: {e}"
        self.agreement.outcomes(error, f"loading {self.ck.initial_load_path}", None)
        if self.rank == 0:
            logger.info("Checkpoint: no checkpoint of this run; loaded %d tensors from %s (%s format) in %.2fs; "
                        "training starts from them at step 0", n, self.ck.initial_load_path,
                        self.ck.initial_load_format, time.monotonic() - started)
