"""A rank under torchrun stops within a second once torchrun's agent, its parent process, is gone.

torchrun starts each rank in a session of its own, so a signal to the launcher's process group (a
scheduler's SIGKILL, a closed terminal) reaches the agent and not the ranks. Without their agent the
ranks would train on unsupervised and keep committing checkpoints, racing a relaunched job that
resumes from the same folder. A daemon thread polls the parent pid; once it changes (the kernel hands
an orphan to init or to a subreaper) the rank logs one line and ends at once, without saving. The
checkpoint commit asks too (``exit_if_agent_gone``), so no step is committed in between two polls.

Why not ``prctl(PR_SET_PDEATHSIG)``: it fires when the *thread* that forked the rank exits, not the
agent's process; its signal would have to be SIGKILL, which leaves no line, since a SIGTERM becomes a
preemption save on every rank (``checkpoint/preemption.py``).

Nothing here imports torch: ``train.py`` starts the watch before its slow imports, so that the
parent it records is the agent even if the agent dies while the rank starts.
"""

from __future__ import annotations

import logging
import os
import threading
import time

# As if hung up (128 + SIGHUP): nobody reads it (the agent is gone), but a shell or a subreaper can.
ORPHANED_EXIT_STATUS = 129
POLL_SECONDS = 0.25

logger = logging.getLogger(__name__)
_agent_pid: int | None = None


def under_torchrun() -> bool:
    """Whether torchrun's agent started this process (it sets ``TORCHELASTIC_RUN_ID`` for its ranks)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def watch_agent(poll_seconds: float = POLL_SECONDS) -> bool:
    """Under torchrun, record the agent (this process's parent) and start the watching thread; once per process.

    Returns whether a watch runs. A plain ``python train.py`` has no agent to lose: a shell that
    started it with ``nohup`` may well exit first.
    """
    global _agent_pid
    if _agent_pid is not None or not under_torchrun():
        return _agent_pid is not None
    # The parent now is the agent: torchrun's rank starts these lines within a fraction of a second.
    # (No test of ppid == 1 for "already orphaned": torchrun may itself be a container's init.)
    _agent_pid = os.getppid()
    threading.Thread(target=_poll, args=(_agent_pid, poll_seconds), name="agent-watch", daemon=True).start()
    return True


def exit_if_agent_gone() -> None:
    """Before an irreversible step (a checkpoint commit): end this rank now if its agent is gone."""
    if _agent_pid is not None and os.getppid() != _agent_pid:
        _stop_orphaned()


def _poll(agent_pid: int, poll_seconds: float) -> None:
    while os.getppid() == agent_pid:
        time.sleep(poll_seconds)
    _stop_orphaned()


def _stop_orphaned() -> None:
    """Log why, then end the process at once: no ``finally``, no save, no collective with peers that may be gone."""
    try:
        logger.error("torchrun's agent (pid %s) is gone, so nothing supervises this rank: stopping it now, "
                     "without saving a checkpoint (exit status %d)", _agent_pid, ORPHANED_EXIT_STATUS)
        for handler in logging.getLogger().handlers:
            handler.flush()
    finally:
        os._exit(ORPHANED_EXIT_STATUS)
