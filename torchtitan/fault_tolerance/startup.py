"""A start in step: a group's first quorum waits for every replica group, up to a timeout.

The lighthouse forms a quorum as soon as ``min_replicas`` groups ask and every group it has
heard from has joined. A group still starting up has not been heard from yet, so without
this wait the first group to arrive commits step 1 alone, with its share of the global
batch, and the later ones heal from it: the model would depend on which process started
first. ``StartupManager`` holds the group's first quorum(s) until all
``num_replica_groups`` groups are in one, or ``startup_timeout_seconds`` have passed since
the first one began (see docs/fault_tolerance_startup.md). It applies to a fresh start and
to a whole-job restart from a checkpoint alike (each process waits once, at its start), and
under DiLoCo/LocalSGD to the first sync (inner steps are local to a group, so a group that
waits at its first sync has done exactly what it would have done starting with the others).

What each quorum of the wait leads to, decided from the quorum (the same in every rank and
every group in it) and one timeout flag the group's ranks agree on:

- a peer is ahead (the job runs already): no wait; this group heals from it as before;
- every group is in: go;
- the timeout has passed: go with those present (torchft commits if they are at least
  ``min_replicas``); the groups missing are logged;
- this group is alone: nobody depends on its collectives, so it asks again shortly, without
  computing the step;
- some groups but not all: the step is computed (those peers wait on its collectives), but
  the commit vote says no, so it is retried with the same batches.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from torchft.manager import Manager, extract_trailing_digits

if TYPE_CHECKING:
    from torchft._torchft import QuorumResult

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.25  # between two quorums of a group that is alone: a late group waits at most this for it

WAIT, GO, HOLD = "wait", "go", "hold"


class _RecordingClient:
    """torchft's manager client, keeping the last quorum it returned (which groups are in it)."""

    def __init__(self, client: Any):
        self._client = client
        self.last: Any = None

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        self.last = self._client._quorum(*args, **kwargs)
        return self.last

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def groups_in(quorum: QuorumResult) -> list[int]:
    """The replica group indices of a quorum (ids are ``replica_group_<i>:<uuid>``)."""
    return sorted(extract_trailing_digits(rid.split(":")[0]) for rid in quorum.replica_ids)


class StartupWait:
    """The decision of each quorum during the wait (pure, apart from the clock)."""

    def __init__(self, num_groups: int, timeout_seconds: float, agree_timed_out: Callable[[bool], bool]):
        self.num_groups, self.timeout_seconds = num_groups, timeout_seconds
        self._agree = agree_timed_out  # the group's ranks must take the same branch: one all-reduce
        self.began: float | None = None
        self.done = timeout_seconds <= 0  # 0: no wait at all (torchft's own behaviour)
        self._announced = False

    def decide(self, quorum: QuorumResult, my_step: int) -> str:
        """WAIT (ask again), GO (this quorum's step may commit) or HOLD (compute it, vote no)."""
        if self.began is None:
            self.began = time.monotonic()
        present = groups_in(quorum)
        if quorum.max_step > my_step:  # the job runs already: heal from it, as a group that comes back does
            return self._finish(f"joined a running job at step {quorum.max_step}", present)
        waited = time.monotonic() - self.began
        if len(present) >= self.num_groups:
            return self._finish(f"all {self.num_groups} replica groups joined after {waited:.1f} s", present)
        if self._agree(waited >= self.timeout_seconds):
            missing = sorted(set(range(self.num_groups)) - set(present))
            logger.warning("Fault tolerance: starting with replica group(s) %s of %d after waiting %.0f s "
                           "(--fault_tolerance.startup_timeout_seconds); missing: group(s) %s", present,
                           self.num_groups, waited, missing)
            self.done = True
            return GO
        if not self._announced:
            logger.info("Fault tolerance: waiting up to %.0f s for all %d replica groups to start (present: %s)",
                        self.timeout_seconds, self.num_groups, present)
            self._announced = True
        return WAIT if len(present) == 1 else HOLD

    def _finish(self, what: str, present: list[int]) -> str:
        logger.info("Fault tolerance: %s (groups %s)", what, present)
        self.done = True
        return GO


class StartupManager(Manager):
    """torchft's Manager whose first quorums wait for every replica group (see the module docstring)."""

    def __init__(self, *args: Any, startup: StartupWait, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._client = _RecordingClient(self._client)
        self.startup = startup
        self._hold: str | None = None  # why this quorum's step must not commit

    def start_quorum(self, allow_heal: bool = True, shrink_only: bool = False, timeout: timedelta | None = None
                     ) -> None:
        self._hold = None
        if self.startup.done:
            return super().start_quorum(allow_heal=allow_heal, shrink_only=shrink_only, timeout=timeout)
        my_step = self.current_step()
        while True:
            super().start_quorum(allow_heal=allow_heal, shrink_only=shrink_only, timeout=timeout)
            self.wait_quorum()  # the decision needs the quorum: the first step does not overlap it with forward
            decision = self.startup.decide(self._client.last, my_step)
            if decision == GO:
                return
            if decision == HOLD:
                self._hold = (f"waiting for all {self.startup.num_groups} replica groups to start: groups "
                              f"{groups_in(self._client.last)} are in")
                return
            time.sleep(POLL_SECONDS)

    def should_commit(self, timeout: timedelta | None = None) -> bool:
        if self._hold is not None:
            # After the step's collectives (peers in this quorum wait on them), before the vote.
            self.report_error(RuntimeError(self._hold))
            self._hold = None
        return super().should_commit(timeout=timeout)
