"""Run a function on N real processes joined by a gloo process group.

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` processes, each of which
initializes ``torch.distributed`` with gloo, calls ``fn(rank, world_size, *args)``
and sends back its (picklable) return value. Any rank's exception fails the
call with that rank's traceback; a rank that hangs fails it after ``timeout``.
``fn`` must be a module-level function so the spawned processes can import it.

The processes are forked from a forkserver that imported torch and the trainer once per test
session, so a world starts in about a second instead of paying for those imports in every
process (8 spawned ranks on 2 cores took 16.5 s under load). Each process takes the caller's
environment as it is at the call, as a spawned one would, and meets the others in a barrier
before ``fn``, so no rank tears down while a peer is still connecting, and again through the
store after it (``shutdown_distributed``), so the rank hosting the store outlives its last use.
"""

from __future__ import annotations

import os
import pickle
import queue
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

from torchtitan.distributed.lifecycle import free_port

mp.set_forkserver_preload(["torch", "torch.distributed", "torchtitan.trainer"])


def _child(fn, rank, world_size, port, args, results, collective_timeout, environ):
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    import torch.distributed as dist

    from torchtitan.distributed.lifecycle import shutdown_distributed

    ok = False
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=collective_timeout))
        dist.barrier()
        # Pickle by value: tensors sent as-is would live in shared memory that dies with this process.
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
        ok = True
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        # The trainer's ending: rank 0 hosts the store, so it leaves only after every rank is done with
        # it. Leaving at once, it reset a slower rank's connection while that rank still made a
        # sub-group (16 ranks on 2 cores, "Connection reset by peer" in new_group).
        shutdown_distributed(ok=ok, timeout_seconds=collective_timeout)


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 180, collective_timeout: int = 60) -> list:
    ctx = mp.get_context("forkserver")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(fn, r, world_size, port, args, results, collective_timeout, dict(os.environ)),
                    daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            rank, ok, value = results.get(timeout=timeout)
            if ok:
                out[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank} failed:\n{value}")
    except queue.Empty:
        errors.append(f"timed out after {timeout}s; ranks that answered: {sorted(out)}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [out[r] for r in range(world_size)]
