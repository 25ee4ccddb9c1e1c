"""The trainer's checkpointing, in one object: load at start, save when due, on SIGTERM and at the end.

``CheckpointManager`` is a small facade over the parts, each in a module of its own:

- ``states.py``: the states a checkpoint holds (model, optimizer, LR schedule, data position,
  train state, RNG, and the run's extra states such as DiLoCo's ``semi_sync``), what each
  one saves and loads, which go into weights-only and seed checkpoints, and what a run does
  when a checkpoint lacks one;
- ``saver.py``: free space checked first, DCP's write (sync or async), the commit;
- ``loader.py``: choosing, verifying and reading the checkpoint to resume from;
- ``agreement.py``: every rank taking the same decision, so no rank waits in a collective
  that another one left;
- ``preemption.py``: SIGTERM turned into a save on every rank.

A ``weights_only`` checkpoint (the final save with ``model_weights_only``) holds
``model`` alone, cast to ``export_dtype``; a ``seed`` checkpoint holds the initialized
``model`` at step 0. How folders are committed and validated: ``store.py``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from torchtitan.checkpoint import s3_client
from torchtitan.checkpoint.agreement import Agreement
from torchtitan.checkpoint.loader import Loader
from torchtitan.checkpoint.location import Location
from torchtitan.checkpoint.preemption import PreemptionWatch
from torchtitan.checkpoint.saver import Saver
from torchtitan.checkpoint.selection import checkpoint_folder
from torchtitan.checkpoint.stage_view import model_view
from torchtitan.checkpoint.states import Holders, StateRegistry
from torchtitan.checkpoint.store import CheckpointKind
from torchtitan.config.job_config import Checkpoint, Comm, FaultTolerance, Job, Training

logger = logging.getLogger(__name__)


def _always() -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
    """What the checkpointer reads of a job: the ``[checkpoint]`` section and a value each of ``[job]``,
    ``[training]``, ``[comm]`` and ``[fault_tolerance]``; built once (``of``) by the trainer."""

    checkpoint: Checkpoint
    folder: Location  # under the dump folder, or an object-store URI (``checkpoint_folder``)
    total_steps: int  # the last step always saves
    init_timeout_seconds: int  # the checkpoint group's timeout is at least this
    tmp_tag: str  # under fault tolerance each replica group writes into temporary folders of its own

    @classmethod
    def of(cls, ck: Checkpoint, job: Job, training: Training, comm: Comm, ft: FaultTolerance) -> CheckpointOptions:
        return cls(ck, checkpoint_folder(ck, job.dump_folder), training.steps, comm.init_timeout_seconds,
                   tmp_tag=f"-group{ft.replica_id}" if ft.enable else "")


class CheckpointManager:
    """Loads at start, saves every ``interval`` steps and at the end, and on SIGTERM.

    The trainer calls ``load()`` before its first step (returns the step to resume
    after), ``maybe_save(step)`` after every step (returns True when the run was
    preempted and must stop now), ``save_seed()`` for a seed checkpoint, and
    ``close()`` before exit (waits for an async save). Every method is called on
    every rank.
    """

    def __init__(self, options: CheckpointOptions, *, model_parts: list[torch.nn.Module],
                 optimizer: torch.optim.Optimizer, lr_scheduler: torch.optim.lr_scheduler.LRScheduler, dataloader,
                 dims, rank: int, model_args=None, writes: Callable[[], bool] | None = None,
                 extra_states: dict[str, Any] | None = None) -> None:
        ck = options.checkpoint
        self.ck = ck
        self.enabled = ck.enable_checkpoint
        initial_load = bool(ck.initial_load_path) and not ck.create_seed_checkpoint
        self.active = ck.enable_checkpoint or ck.create_seed_checkpoint or initial_load
        self.folder = options.folder
        self.total_steps = options.total_steps
        self.rank = rank
        self.preemption = PreemptionWatch(ck.preemption_check_steps)
        self._closed = False
        # Fault tolerance: one live replica group writes the job's checkpoints (``writes`` says whether
        # this one does, per save), each group into a temporary folder of its own.
        self.writes: Callable[[], bool] = writes or _always
        if not self.active:
            return
        s3_client.configure(s3_client.S3Timeouts.from_config(ck))  # as preflight did: a stalled store fails in time
        holders = Holders(model=model_view(model_parts), optimizer=optimizer, lr_scheduler=lr_scheduler,
                          dataset=dataloader.dataset, rank=rank)
        states = StateRegistry(holders, extra_states)
        group = None
        if dist.is_initialized():
            # A gloo group of its own: an async save runs its collectives in a background
            # thread, which must never interleave with the training thread's collectives on
            # a shared group; gloo also carries DCP's CPU-side coordination under NCCL.
            timeout = timedelta(seconds=max(options.init_timeout_seconds, 1800))
            group = dist.new_group(backend="gloo", timeout=timeout)
            assert isinstance(group, dist.ProcessGroup), "a group of every rank has this rank in it"
        # The layout a checkpoint records: a load into another layout does not restore per-rank states.
        agreement, layout = Agreement(group, self.folder), dims.layout()
        self.saver = Saver(ck, self.folder, states, agreement, rank=rank, layout=layout, tmp_tag=options.tmp_tag)
        self.loader = Loader(ck, self.folder, states, agreement, rank=rank, layout=layout, model_args=model_args)
        if self.enabled:
            self.preemption.install()

    # ---- loading ---------------------------------------------------------------
    def load(self) -> int:
        """Load the chosen checkpoint (if any); return the step to continue after (0: from scratch).

        Without a checkpoint of its own the run starts from ``initial_load_path`` when set;
        a failure on one rank is the same error on every rank (``loader.py``).
        """
        if not self.active:
            return 0
        step = self.loader.load()
        if self.loader.loaded_step is not None:
            self.saver.protected = {self.loader.loaded_step}  # never purged by this run's saves
        return step

    def reload_latest(self) -> int | None:
        """Mid-run: wait for a pending save, then load the latest checkpoint again; its step, or None when there is
        none of this run's own to load (a rollback, stability/rollback.py)."""
        if not self.enabled:
            return None
        self.saver.finish_pending(block=True)
        # The latest and all of it: --checkpoint.load_step and exclude_from_loading were for the run's start.
        self.loader.ck = dataclasses.replace(self.ck, load_step=-1, exclude_from_loading=[])
        self.loader.loaded_step = None
        step = self.loader.load()
        return step if self.loader.loaded_step is not None else None

    # ---- saving ----------------------------------------------------------------
    def save(self, step: int, *, kind: str = CheckpointKind.FULL, sync: bool = True) -> None:
        """Write a checkpoint of the current state (a collective: every rank calls it)."""
        self.saver.write(step, kind, self.saver.state(step, kind), sync)

    def save_seed(self) -> None:
        """Write the freshly initialized model as step 0, for any layout to start from."""
        self.saver.write(0, CheckpointKind.SEED, self.saver.state(0, CheckpointKind.SEED), sync=True)

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
        self.saver.finish_pending(block=False)  # make a finished async save visible early
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
            self.saver.finish_pending(together=wait_for_peers)
            if wait_for_peers:
                self.saver.barrier()
        finally:
            self.preemption.uninstall()
