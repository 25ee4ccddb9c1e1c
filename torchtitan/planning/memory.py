"""Per-rank memory of a dry-run step: every storage the step allocates, counted at its local size, by category.

``MemoryLedger`` is fed by the dry run's dispatch mode (``dry_run.StepRecorder``): each op's outputs
are registered once per storage, at the storage's local bytes (a DTensor's local shard, never its
global shape), and a weak reference removes them when the storage dies. The category is the phase
the storage was allocated in, re-tagged where the step tells more (an FSDP all-gather's output is a
gathered parameter; a reduce-scatter's output is a gradient shard). The peak keeps its split.

Storages that FSDP2 resizes in place (its unsharded parameters, freed and re-allocated around every
forward and backward of a block) are followed through ``note_resize``.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor

from torchtitan.compat import dtensor_local, storage_id

GIB = 2**30

# The categories of the report, in its order. ``activations`` are forward outputs kept for backward;
# ``in_flight`` those of other pipeline micro-batches than the one running; ``backward`` the
# activation gradients and recomputed activations that live only during backward.
CATEGORIES = ("parameters", "gathered_parameters", "gradients", "optimizer", "activations", "in_flight",
              "logits_and_loss", "backward", "buffers")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage a rank really holds: a DTensor's local shard, else the tensor."""
    return dtensor_local(t) if isinstance(t, DTensor) else t


@dataclass
class MemoryReport:
    """One rank's peak and its split (bytes), and the figures around it."""

    peak_bytes: int
    at_peak: dict[str, int]
    final: dict[str, int]  # after the last step (what stays: parameters, optimizer state, buffers)
    peak_phase: str
    # Where the step was (``MemoryLedger.enter``) and the highest total there: [name, bytes, split, phase].
    regions: list[list] = field(default_factory=list, repr=False)

    def to_json(self) -> dict:
        return {"peak_gib": self.peak_bytes / GIB, "peak_phase": self.peak_phase,
                "at_peak_gib": {k: v / GIB for k, v in self.at_peak.items()},
                "after_step_gib": {k: v / GIB for k, v in self.final.items()}}


@dataclass
class MemoryLedger:
    """Live storages of this rank, their bytes and categories, and the peak."""

    tag: str = "buffers"  # the category new storages get; the dry run sets it per phase
    _live: dict[int, list] = field(default_factory=dict)  # storage id -> [bytes, category, weakref]
    _totals: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    total: int = 0
    peak: int = 0
    peak_split: dict[str, int] = field(default_factory=dict)
    peak_phase: str = ""
    phase: str = "build"
    regions: list[list] = field(default_factory=list)  # [name, highest total, its split, its phase], in order

    def enter(self, name: str) -> None:
        """The step enters a new region (a block's forward or backward: ``symmetry.py``); its highest total
        starts at the total now."""
        self.regions.append([name, self.total, dict(self._totals), self.phase])

    def register(self, t: torch.Tensor, category: str | None = None) -> None:
        """Count ``t``'s storage once (later views of it are free); ``category`` re-tags a known one."""
        storage = local_tensor(t).untyped_storage()
        key = storage_id(storage)
        entry = self._live.get(key)
        if entry is None:
            nbytes = storage.nbytes()
            ref = weakref.ref(storage, lambda _, key=key: self._free(key))
            self._live[key] = [nbytes, category or self.tag, ref]
            self._add(category or self.tag, nbytes)
        elif category is not None and entry[1] != category:
            self._totals[entry[1]] -= entry[0]
            self._totals[category] += entry[0]
            entry[1] = category

    def note_resize(self, t: torch.Tensor, category: str) -> None:
        """A storage resized in place (FSDP2's unsharded parameters): count its new size."""
        storage = local_tensor(t).untyped_storage()
        entry = self._live.get(storage_id(storage))
        if entry is None:
            self.register(t, category)
            return
        delta = storage.nbytes() - entry[0]
        self._totals[entry[1]] -= entry[0]
        entry[0], entry[1] = storage.nbytes(), category
        self._totals[category] += entry[0]
        self.total += delta
        self._check_peak()

    def _add(self, category: str, nbytes: int) -> None:
        self._totals[category] += nbytes
        self.total += nbytes
        self._check_peak()

    def _check_peak(self) -> None:
        if self.total > self.peak:
            self.peak, self.peak_split, self.peak_phase = self.total, dict(self._totals), self.phase
        if self.regions and self.total > self.regions[-1][1]:
            self.regions[-1][1:] = [self.total, dict(self._totals), self.phase]

    def _free(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self._totals[entry[1]] -= entry[0]
            self.total -= entry[0]

    def totals(self) -> dict[str, int]:
        return fold(self._totals)

    def report(self) -> MemoryReport:
        return MemoryReport(peak_bytes=self.peak, at_peak=fold(self.peak_split), final=self.totals(),
                            peak_phase=self.peak_phase, regions=self.regions)


def fold(totals: dict[str, int]) -> dict[str, int]:
    """The report's categories from the ledger's tags: forward tensors are tagged by (pipeline stage and)
    micro-batch; the largest micro-batch counts as ``activations``, the others as ``in_flight``."""
    out: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
    acts = sorted((v for k, v in totals.items() if k.startswith("activations@")), reverse=True)
    if acts:
        out["activations"], out["in_flight"] = acts[0], sum(acts[1:])
    for k, v in totals.items():
        if not k.startswith("activations@"):
            out[k] = out.get(k, 0) + v
    return out
