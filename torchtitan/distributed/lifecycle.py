"""Process-group lifecycle: join the job, shorten timeouts once it runs, leave it in order.

``train.py`` calls ``init_distributed`` through the trainer and ``shutdown_distributed`` as
the last thing a rank does, on success and on failure alike.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from torchtitan.compat import TCPStore, all_process_groups, default_store, set_pg_timeout

# The pid of a process init_distributed made a one-rank group for (no torchrun); children inherit other pids.
_ONE_PROCESS_MARK = "TORCHTITAN_ONE_PROCESS"


def device_type() -> str:
    """The accelerator when there is one, else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def free_port() -> int:
    """A TCP port that was free a moment ago on this host (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(init_timeout_seconds: int) -> tuple[int, int, torch.device]:
    """Join (or, for a plain ``python train.py``, create) the default process group.

    Returns (rank, world_size, device). CUDA gets NCCL for its tensors plus gloo
    for the occasional CPU tensor; a machine without GPUs gets gloo alone.
    """
    timeout = timedelta(seconds=init_timeout_seconds)
    one_process: dict = {}
    # A process that made its own group before (a test training twice) finds RANK set by that first
    # call; it is still one process, and the MASTER_PORT left behind is the old store's, not a launcher's.
    made_here = os.environ.get(_ONE_PROCESS_MARK) == str(os.getpid())  # a child's pid differs: not inherited
    if "RANK" not in os.environ or made_here:
        # A single process without torchrun: make a one-rank group so the code path is the same.
        user_port = "MASTER_PORT" in os.environ and not made_here
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ[_ONE_PROCESS_MARK] = str(os.getpid())
        if not user_port and not dist.is_initialized():
            one_process = _one_process_store(timeout)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type() == "cuda":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timeout, **(one_process or _restart_round_store(timeout)))
    return dist.get_rank(), dist.get_world_size(), device


def _one_process_store(timeout: timedelta) -> dict:
    """A one-rank group's store, on a port the OS picks as the store binds it.

    A port found free first and bound later can be taken in between by another job on the host
    (EADDRINUSE at start, seen when tests run side by side); binding port 0 leaves no such gap.
    """
    store = TCPStore("127.0.0.1", 0, world_size=1, is_master=True, timeout=timeout)
    os.environ["MASTER_PORT"] = str(store.port)  # for what reads the group's address from the environment
    return {"store": store, "rank": 0, "world_size": 1}


def _restart_round_store(timeout: timedelta) -> dict:
    """After a ``torchrun --max-restarts`` restart, the default group's keys under a prefix of that round.

    torchrun's agent keeps its store across rounds, and the group's keys (gloo's rank
    addresses among them) have fixed names: a restarted rank could read a dead rank's
    address and fail to connect. The first round keeps the plain ``env://`` set-up.
    """
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = _agent_store(timeout)
    return {"store": c10d.PrefixStore(f"torchtitan/round_{restart}", store), "rank": int(os.environ["RANK"]),
            "world_size": int(os.environ["WORLD_SIZE"])}


def _agent_store(timeout: timedelta) -> TCPStore:
    """A client of torchrun's agent store (``TORCHELASTIC_USE_AGENT_STORE``): it outlives every worker and restart."""
    return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)


def _store_barrier(name: str, timeout: timedelta) -> None:
    """Wait until every rank of the default group got here, through the store, not a collective.

    A collective here could pair up with a collective that a peer is still stuck in; the
    store cannot. The rank hosting the store (rank 0 without torchrun's agent) waits until
    every rank has seen the barrier open, so that no rank is left asking a store that is gone.
    """
    store = default_store()
    world = dist.get_world_size()
    # torchrun keeps its store across restarts of the workers: one key per attempt.
    key = f"torchtitan/{name}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if store.add(f"{key}/arrived", 1) == world:
        store.set(f"{key}/open", "1")
    store.wait([f"{key}/open"], timeout)
    left = store.add(f"{key}/left", 1)
    if dist.get_rank() == 0:
        deadline = time.monotonic() + timeout.total_seconds()
        while left < world and time.monotonic() < deadline:
            time.sleep(0.01)
            left = store.add(f"{key}/left", 0)


def wait_for_peer_reports(reason: str, timeout_seconds: float = 10.0) -> bool:
    """Before a rank exits on a failure that every rank reports (a config error, a full disk): wait for the others.

    torchrun stops every rank as soon as one exits non-zero, so a rank that reports and
    exits first can cut a slower peer off before that peer has printed its own line. Each
    rank counts itself in through torchrun's agent store (not a collective: there may be no
    process group yet, or a peer may be stuck in one) and waits, at most ``timeout_seconds``,
    until every rank has. Without torchrun's agent nothing stops the peers early: no wait.
    Returns whether every rank reported in time.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return True
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    key = f"torchtitan/reported/{reason}/{attempt}"
    deadline = time.monotonic() + timeout_seconds
    try:
        store = _agent_store(timedelta(seconds=timeout_seconds))
        count = store.add(key, 1)
        while count < world and time.monotonic() < deadline:
            time.sleep(0.05)
            count = store.add(key, 0)
    except (RuntimeError, KeyError, ValueError):  # no store to reach: leave as before
        return False
    return count >= world


def shutdown_distributed(ok: bool, timeout_seconds: float) -> bool:
    """The last thing a rank does: meet the others (on success), then destroy every process group.

    On success every rank waits, at most ``timeout_seconds``, until all ranks have finished
    (their final save and metrics closed), so that no rank tears its connections down while
    a peer still talks to it. Then every group is destroyed and collected while the
    interpreter is fully alive: a gloo group left to the interpreter's own exit can take
    the process down with SIGABRT ("terminate called without an active exception") when
    its threads' last references go after Python's teardown has begun.

    After a failure (``ok=False``) nothing waits for the peers, which may be stuck in a
    collective this rank never joins; gloo groups are still destroyed (closing their
    connections fails the peers' collectives at once), NCCL ones are not (destroying a
    communicator while a peer uses it can block), and the launcher stops the rest.
    Returns whether there was a process group to leave.
    """
    if not dist.is_initialized():
        return False
    if ok and dist.get_world_size() > 1:
        try:
            _store_barrier("shutdown", timedelta(seconds=timeout_seconds))
        except RuntimeError as e:  # a timeout or a lost store (DistStoreError): leave anyway
            logging.getLogger(__name__).warning(
                "Shutdown: not every rank finished within %.0f s (%s); leaving anyway", timeout_seconds, e)
    if ok or "nccl" not in str(dist.get_backend()):
        dist.destroy_process_group()
    gc.collect()  # the groups' last references go now, not during the interpreter's exit
    return True


def set_collective_timeout(seconds: int) -> int:
    """Shorten the collective timeout of every process group this process belongs to; return how many.

    Called once the slow first step is done, so that a dead or hung rank ends the job.
    "Every group" is every group created so far, not only the root mesh's dims: the
    flattened views (FSDP's ``dp_shard_cp``, the loss sums' ``dp_cp``), the unit-shard
    mesh of DDP/TP layouts and the checkpoint group hang just as well as the default one.
    One-rank groups are left alone: a collective over one rank waits for no peer, and
    torch builds some of them (a mesh dim of size 1) on a local backend that has no
    timeout to set (the call would only warn).
    """
    timeout = timedelta(seconds=seconds)
    groups = [group for group in all_process_groups() if group.size() > 1]
    for group in groups:
        set_pg_timeout(timeout, group)
    return len(groups)
