"""Writing checkpoints: the state a save holds, free space checked first, DCP's write, the commit.

A save writes into ``step-N.tmp`` and rank 0 commits it (manifest, checksums, rename; see
``store.py``) once every rank's files are written, so a crash never leaves a visible
partial checkpoint. A save that cannot fit, or fills the disk midway, ends the job with
one ``DiskFullError`` line on every rank (``space.py``). An async save runs DCP's writes
in the background and is committed later, at the next save, ``maybe_save`` or ``close``.
In an object store (``location.py``) the save is written straight into ``step-N/`` and its
manifest, put only if absent, commits it; there is no free space to measure, so that check is skipped.
A store that stops answering fails the save within its timeouts (``s3_client.py``) with one
``StoreUnansweredError`` line naming the endpoint; an async save's failure is logged as soon as a
step sees it, and raised on every rank at the next save or at the end, as any failed async save is.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# torch.distributed.checkpoint.save/async_save, from their defining module: the package does not list them.
from torch.distributed.checkpoint import state_dict_saver as dcp
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from torchtitan.agent_watch import exit_if_agent_gone
from torchtitan.checkpoint import integrity, s3_client, space
from torchtitan.checkpoint.agreement import Agreement
from torchtitan.checkpoint.location import Location, RemotePath, remove_tree
from torchtitan.checkpoint.states import StateRegistry
from torchtitan.checkpoint.store import CheckpointKind, commit, purge, tmp_dir, uncommit
from torchtitan.config.dtypes import DTYPES

logger = logging.getLogger(__name__)


@dataclass
class _PendingSave:
    step: int
    kind: str
    future: Future
    started: float
    writer: FileSystemWriter
    needed: int
    reported: bool = False  # its failure was logged when a step first saw it


class Saver:
    """Writes and commits this run's checkpoints into ``folder``; every method is called on every rank."""

    def __init__(self, ck: Any, folder: Location, states: StateRegistry, agreement: Agreement, *, rank: int,
                 layout: dict[str, int], tmp_tag: str = "") -> None:
        self.ck, self.folder, self.states, self.agreement = ck, folder, states, agreement
        self.rank, self.layout = rank, layout
        self.tmp_tag = tmp_tag  # fault tolerance: each replica group writes into a temporary folder of its own
        self.pending: _PendingSave | None = None
        self.protected: set[int] = set()  # steps never purged: the checkpoint this run loaded

    def state(self, step: int, kind: str) -> dict[str, Any]:
        """What a save of ``kind`` holds: every state, or the model alone (weights-only: cast to ``export_dtype``)."""
        state = self.states.save_state(step, model_only=kind in CheckpointKind.MODEL_ONLY)
        if kind == CheckpointKind.WEIGHTS_ONLY:
            dtype = DTYPES[self.ck.export_dtype]
            state["model"] = {k: v.detach().to(dtype) if v.is_floating_point() else v
                              for k, v in state["model"].items()}
        return state

    def barrier(self) -> None:
        if self.agreement.group is not None:
            dist.barrier(group=self.agreement.group)

    def write(self, step: int, kind: str, state: dict[str, Any], sync: bool) -> None:
        """Write ``state`` as checkpoint ``step`` of ``kind``: committed here when ``sync``, else later."""
        try:
            self._write(step, kind, state, sync)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            self._raise_if_unanswered(e, step)
            raise

    def _write(self, step: int, kind: str, state: dict[str, Any], sync: bool) -> None:
        self.finish_pending()
        tmp = tmp_dir(self.folder, step, self.tmp_tag)
        if self.rank == 0 and tmp.exists():
            # An earlier attempt at this step was interrupted; it was never visible. In an object store this
            # is also a step an older run committed beyond the one this run resumed from: it is replaced.
            uncommit(tmp)
        self.barrier()  # nobody measures the free space, nor creates files in tmp, before rank 0 cleared it
        needed = self._check_space(step, kind, state)
        writer = integrity.checkpoint_writer(tmp, self.ck.checksums)
        started = time.monotonic()
        group = self.agreement.group
        if sync:
            try:
                dcp.save(state, storage_writer=writer, process_group=group)
            except BaseException as e:  # DCP's CheckpointException is a BaseException
                self._raise_if_disk_full(e, step, needed, together=True)
                raise
            self._commit(step, kind, started, writer)
        else:
            response = dcp.async_save(state, storage_writer=writer, process_group=group)
            # torch returns a Future, or with custom staging a response holding one.
            future = response if isinstance(response, Future) else response.upload_completion
            self.pending = _PendingSave(step, kind, future, started, writer, needed)
            if self.rank == 0:
                logger.info("Checkpoint step %d: async save started (staged in %.2fs)", step,
                            time.monotonic() - started)

    def _check_space(self, step: int, kind: str, state: dict[str, Any]) -> int:
        """Before any write: the bytes this save needs; DiskFullError on every rank when any rank lacks them.

        The ranks agree (one gather of each one's free space and state sizes) because their
        measures of a shared file system may differ by what others wrote meanwhile, and a
        rank that raised alone would leave the others waiting in DCP's collectives; the
        union of the state sizes is also the whole save's under pipeline parallelism. An object
        store has no free space to measure (every rank sees the same folder, so all skip alike).
        """
        if isinstance(self.folder, RemotePath):
            return 0
        previous = space.previous_size(self.folder, kind)
        sizes = {} if previous else space.state_sizes(state)
        outcomes = self.agreement.gather((space.free_bytes(self.folder), sizes))
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
        if not space.is_disk_full(error) or isinstance(self.folder, RemotePath):
            return
        tmp = tmp_dir(self.folder, step, self.tmp_tag)
        if self.rank == 0:
            remove_tree(tmp)  # every rank is past its writes: DCP failed them together
        if together:
            self.barrier()
        raise space.DiskFullError(space.disk_full_line(self.folder, step, needed, space.free_bytes(self.folder),
                                                       midway=True)) from None

    def _raise_if_unanswered(self, error: BaseException, step: int) -> None:
        """A save (its listing, writes or commit) that failed because the object store did not answer: one line
        naming the endpoint."""
        if isinstance(error, s3_client.StoreUnansweredError):
            return  # already that line (a pending save's, raised by the next save)
        line = s3_client.unanswered_line(error, f"checkpoint step {step} was not saved")
        if line is not None:
            raise s3_client.StoreUnansweredError(line) from None

    def _report_if_unanswered(self, pending: _PendingSave) -> None:
        """An async save that failed in the background because the store did not answer: logged at once."""
        if pending.reported or not pending.future.done():
            return
        error = pending.future.exception()
        if error is None:
            return
        line = s3_client.unanswered_line(error, f"checkpoint step {pending.step} was not saved")
        if line is not None:
            pending.reported = True
            logger.error("%s; the job ends at the next save or at its end", line)

    def _commit(self, step: int, kind: str, started: float, writer: FileSystemWriter) -> None:
        # DCP's save returns on rank 0 only after every rank reported its writes and the
        # global metadata is written, so rank 0 alone can make the checkpoint visible.
        if self.rank != 0:
            return
        manifest = {"kind": kind, "states": self.states.names(model_only=kind in CheckpointKind.MODEL_ONLY),
                    "layout": self.layout,
                    "dtype": self.ck.export_dtype if kind == CheckpointKind.WEIGHTS_ONLY else "as trained",
                    "torch_version": torch.__version__}
        if isinstance(writer, integrity.ChecksummingWriter):
            tmp = tmp_dir(self.folder, step, self.tmp_tag)
            manifest["checksums"] = integrity.collect(tmp, writer.metadata_checksum())
        exit_if_agent_gone()  # a rank left running by a killed launcher must not commit (agent_watch.py)
        path = commit(self.folder, step, manifest, self.tmp_tag)
        logger.info("Checkpoint step %d saved to %s (%s, %.2fs)", step, path, kind, time.monotonic() - started)
        # Never the checkpoint this run loaded, nor the one just written (an older run may have left higher steps).
        for gone in purge(self.folder, self.ck.keep_latest_k, {step} | self.protected):
            logger.info("Checkpoint: deleted %s (keep_latest_k=%d)", gone, self.ck.keep_latest_k)

    def finish_pending(self, block: bool = True, together: bool = True) -> None:
        """Commit a finished async save; ``block`` waits for it, else only a successful one is taken.

        A failed save is left pending until a blocking call, which every rank makes at the same
        point (the next save, or ``close``): the ranks see a failure at different steps, and one
        that stopped alone would leave the others waiting in a collective, its line unprinted by
        them. ``together``: every rank is here (``close`` after a failure on this rank is not).
        """
        pending = self.pending
        if pending is None:
            return
        if not block and not (pending.future.done() and pending.future.exception() is None):
            self._report_if_unanswered(pending)
            return
        self.pending = None
        try:
            self._finish(pending, together)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            self._raise_if_unanswered(e, pending.step)
            raise

    def _finish(self, pending: _PendingSave, together: bool) -> None:
        try:
            pending.future.result()  # re-raises a failed save on this rank
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            self._raise_if_disk_full(e, pending.step, pending.needed, together=together)
            raise
        self._commit(pending.step, pending.kind, pending.started, pending.writer)
