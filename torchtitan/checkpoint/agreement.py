"""All ranks take the same decision: a failure on one rank becomes the same error on every rank.

A rank that raised alone would leave the others waiting in the next collective until the
group's timeout (30 minutes for the checkpoint group). So each phase that may fail on some
ranks (choosing, verifying, reading and setting a checkpoint; measuring free space) ends with
one gather of every rank's outcome, and every rank then raises, or goes on, alike.

``Agreement`` runs on the checkpoint's own gloo group (an async save's background thread
uses it, never the training thread's collectives). ``any_rank`` runs on the default group,
from the training thread, for the preemption flag: the checkpoint group may be busy with an
async save then.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from torchtitan.checkpoint.location import Location

T = TypeVar("T")


class Agreement:
    """Gathers one outcome per rank of ``group`` (None: this process alone) and raises alike on every rank."""

    def __init__(self, group: dist.ProcessGroup | None, folder: Location) -> None:
        self.group = group
        self.folder = folder  # the checkpoint folder, named when ranks see it differently

    @property
    def world(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    def gather(self, item: T) -> list[T]:
        """Every rank's ``item``, in rank order (one ``all_gather_object``; none alone)."""
        if self.world == 1:
            return [item]
        outcomes = [item] * self.world  # each entry replaced by its rank's item
        dist.all_gather_object(outcomes, item, group=self.group)
        return outcomes

    def outcomes(self, error: str | None, doing: str, item: T) -> list[T]:
        """Every rank's ``item`` when no rank failed at ``doing``; else, on every rank, the failing ranks' messages.

        ``error`` is this rank's failure (None: it succeeded). Nothing is deleted on a failure:
        the message says so.
        """
        gathered = self.gather((error, item))
        if self.world == 1:
            if error is not None:
                raise RuntimeError(f"checkpoint: {doing} failed (nothing was deleted): {error}")
            return [item]
        failed = [f"rank {r}: {e}" for r, (e, _) in enumerate(gathered) if e is not None]
        if failed:
            raise RuntimeError(f"checkpoint: {doing} failed on {len(failed)} of {self.world} ranks (nothing was "
                               f"deleted): " + " | ".join(failed))
        return [shared for _, shared in gathered]

    def same_checkpoint(self, names: Sequence[Hashable]) -> None:
        """Raise on every rank when the ranks chose different checkpoints (a folder that is not shared)."""
        if len(set(names)) != 1:
            raise RuntimeError(f"ranks see different checkpoints in {self.folder}: {names}; the checkpoint "
                               "folder must be one shared file system path")


def any_rank(flag: bool) -> bool:
    """True on every rank if ``flag`` is True on any rank: one tiny all-reduce (MAX) on the default group."""
    value = torch.tensor([1 if flag else 0], dtype=torch.int32)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())
