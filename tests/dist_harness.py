"""Run a function on N real processes joined by a gloo process group.

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` processes, each of which
initializes ``torch.distributed`` with gloo, calls ``fn(rank, world_size, *args)``
and sends back its (picklable) return value. Any rank's exception fails the
call with that rank's traceback; a rank that dies without answering (a signal) fails it
as soon as its exit is seen; a rank that hangs fails it after ``timeout``. ``log_dir``
gives each rank a log file, whose end comes with the failure of a rank that died or hung (with the Python
stacks of a rank that died of a native crash: each rank enables ``faulthandler``).
``fn`` must be a module-level function so the spawned processes can import it.

The processes are forked from a forkserver that imported torch and the trainer once per test
session, so a world starts in about a second instead of paying for those imports in every
process (8 spawned ranks on 2 cores took 16.5 s under load). Each process takes the caller's
environment as it is at the call (plus ``env``), as a spawned one would, with the settings torch
reads at import applied again, and meets the others in a barrier
before ``fn``, so no rank tears down while a peer is still connecting, and again through the
store after it (``shutdown_distributed``), so the rank hosting the store outlives its last use.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import queue
import signal
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from typing import Any

import torch.multiprocessing as mp

from torchtitan.distributed.lifecycle import free_port

mp.set_forkserver_preload(["torch", "torch.distributed", "torchtitan.trainer"])


def _child(fn, rank, world_size, port, args, results, collective_timeout, environ, log_dir):
    if log_dir is not None:  # this rank's output, C++'s included ("terminate called ..."), into its own file
        log = os.open(_log_path(log_dir, rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(log, 1)
        os.dup2(log, 2)
    # A native crash (SIGSEGV, SIGABRT) leaves the Python stack of every thread in the log, not only a signal.
    faulthandler.enable(all_threads=True)
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    _apply_import_time_settings()
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


def _apply_import_time_settings() -> None:
    """What a started process reads from its environment when it imports torch, applied to this forked one.

    The forkserver imported torch (and the compiler) with the caller's environment of that moment, so a
    variable set for one call would otherwise be ignored: the intra-op threads, and the compiler's worker
    count (TORCHINDUCTOR_COMPILE_THREADS=1: no pool of compile workers).
    """
    import torch

    if "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if "TORCHINDUCTOR_COMPILE_THREADS" in os.environ:
        import torch._inductor.config as inductor_config

        inductor_config.compile_threads = int(os.environ["TORCHINDUCTOR_COMPILE_THREADS"])


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 180, collective_timeout: int = 60,
              env: dict[str, str] | None = None, log_dir: str | None = None) -> list:
    """``fn(rank, world_size, *args)`` on ``world_size`` forked ranks; their return values by rank.

    ``env`` adds to the caller's environment for the ranks. A rank that raises fails the call with its
    traceback; one that dies without answering (a signal: SIGABRT from a C++ ``terminate``, the OOM
    killer's SIGKILL) fails it as soon as that is seen, naming the signal; ``timeout`` bounds the wait
    for each answer. With ``log_dir`` each rank writes its output to ``rank{N}.log`` there, and the end
    of the log of a rank that died or hung comes with the failure (without it, the ranks write to the
    output the forkserver was started with).
    """
    ctx = mp.get_context("forkserver")
    results = ctx.Queue()
    port = free_port()
    environ = {**os.environ, **(env or {})}
    procs = [
        ctx.Process(target=_child, args=(fn, r, world_size, port, args, results, collective_timeout, environ, log_dir),
                    daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: list[str] = []
    try:
        silent = _collect(procs, results, timeout, out, errors)
        if log_dir is not None:
            errors.extend(_log_tail(log_dir, r) for r in silent)
    finally:
        for p in procs:  # after a failure the others may wait for the failed rank in vain: stopped at once
            p.join(timeout=0 if errors else 10)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [out[r] for r in range(world_size)]


def _collect(procs: list[BaseProcess], results: Queue, timeout: float, out: dict[int, Any],
             errors: list[str]) -> list[int]:
    """Every rank's answer into ``out`` (or ``errors``), until all answered, one died silently, or ``timeout``
    passed with no answer; returns the ranks that never answered."""
    answered: set[int] = set()
    waited = 0.0
    while len(answered) < len(procs):
        try:
            rank, ok, value = results.get(timeout=1.0)
        except queue.Empty:
            waited += 1.0
            # A rank that exited without answering never will: its answer is in the pipe before it exits,
            # so one that is not there once the pipe is drained after the exit was never sent.
            exited = [r for r, p in enumerate(procs) if r not in answered and p.exitcode is not None]
            while exited:
                try:
                    rank, ok, value = results.get(timeout=0.5)
                except queue.Empty:
                    break
                _record(rank, ok, value, answered, out, errors)
            dead = [r for r in exited if r not in answered]
            if dead:
                errors.extend(f"rank {r} died without answering: {_exit_reason(procs[r].exitcode)}" for r in dead)
                return dead
            if waited >= timeout:
                errors.append(f"timed out after {timeout}s; ranks that answered: {sorted(answered)}")
                return [r for r in range(len(procs)) if r not in answered]
            continue
        waited = 0.0
        _record(rank, ok, value, answered, out, errors)
    return []


def _record(rank: int, ok: bool, value: bytes | str, answered: set[int], out: dict[int, Any],
            errors: list[str]) -> None:
    answered.add(rank)
    if ok:
        out[rank] = pickle.loads(value)
    else:
        errors.append(f"rank {rank} failed:\n{value}")


def _log_path(log_dir: str, rank: int) -> str:
    return os.path.join(log_dir, f"rank{rank}.log")


def _log_tail(log_dir: str, rank: int, chars: int = 4000) -> str:
    try:
        with open(_log_path(log_dir, rank), errors="replace") as f:
            text = f.read()
    except FileNotFoundError:
        text = ""
    return f"the end of rank {rank}'s output:\n{text[-chars:]}"


def _exit_reason(exitcode: int) -> str:
    if exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}"
    return f"exit code {exitcode}"
