"""Helpers shared by the CPU benchmarks: launching ranks, building a trainer, counting bytes.

Each benchmark script runs in two roles. Called by a user it is the *driver*: it starts
one ``torchrun`` per layout that re-runs the same script with ``--worker``, collects the
JSON that rank 0 writes, and prints a table. The *worker* role builds the project's
``Trainer`` exactly as ``train.py`` does (same config parsing, same debug config), so the
figures describe the code users run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

DEBUG_CONFIG = str(REPO / "train_configs" / "debug_model.toml")


@dataclasses.dataclass(frozen=True)
class Layout:
    """A layout of the debug model: name, process count, parallel degrees and extra overrides."""

    name: str
    world: int
    replicate: int
    shard: int
    tp: int = 1
    cp: int = 1
    pp: int = 1
    extra: tuple[str, ...] = ()

    @property
    def overrides(self) -> list[str]:
        return [f"--parallelism.data_parallel_replicate_degree={self.replicate}",
                f"--parallelism.data_parallel_shard_degree={self.shard}",
                f"--parallelism.tensor_parallel_degree={self.tp}",
                f"--parallelism.context_parallel_degree={self.cp}",
                f"--parallelism.pipeline_parallel_degree={self.pp}",
                *self.extra]


# PP needs a local batch of at least one sample per microbatch (2 stages -> 2 microbatches).
_PP_BATCH = ("--training.batch_size=2",)

LAYOUTS: dict[str, Layout] = {
    "fsdp2": Layout("FSDP 2", 2, 1, 2),
    "fsdp8": Layout("FSDP 8", 8, 1, 8),
    "hsdp2x4": Layout("HSDP 2x4", 8, 2, 4),
    "ddp8": Layout("DDP 8", 8, 8, 1),
    "tp2": Layout("TP 2", 2, 1, 1, tp=2),
    "tp2_nosp": Layout("TP 2, no SP", 2, 1, 1, tp=2, extra=("--parallelism.enable_sequence_parallel=false",)),
    "fsdp4_tp2": Layout("FSDP 4 x TP 2", 8, 1, 4, tp=2),
    "fsdp4_cp2": Layout("FSDP 4 x CP 2", 8, 1, 4, cp=2),
    "pp2": Layout("PP 2 (1F1B)", 2, 1, 1, pp=2, extra=_PP_BATCH),
    "pp2_fsdp4": Layout("PP 2 x FSDP 4", 8, 1, 4, pp=2, extra=_PP_BATCH),
    "fsdp2_tp2_cp2": Layout("FSDP 2 x TP 2 x CP 2", 8, 1, 2, tp=2, cp=2),
    "pp2_fsdp2_tp2": Layout("PP 2 x FSDP 2 x TP 2", 8, 1, 2, tp=2, pp=2, extra=_PP_BATCH),
}


def machine_description() -> str:
    """One line naming the CPU, the core count and the torch version (for the reports)."""
    import platform

    import torch

    model = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, torch {torch.__version__}, Python {platform.python_version()}"


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def benchmark_parser(doc: str | None) -> argparse.ArgumentParser:
    """The parser of a script that drives ``run_workers``: its own options go on top of the worker role's.

    ``--worker``, ``--result`` and ``--dump`` are what ``run_workers`` passes to the script it
    re-runs under torchrun (hidden from ``--help``); trainer overrides come last, after ``--``.
    """
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--dump", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="extra config overrides for the trainer, after --")
    return parser


def run_workers(script: str, layout: Layout, worker_args: list[str], overrides: Iterable[str] = (),
                timeout: float = 1800) -> dict[str, Any]:
    """Run ``script --worker`` under torchrun with ``layout.world`` CPU ranks; return rank 0's JSON.

    A failed launch fails the benchmark with the workers' output: a rank that dies, at
    exit included, is a bug to fix, not noise to retry (``scripts/stress_exit.py`` counts them).
    """
    with tempfile.TemporaryDirectory(prefix="tt_bench_") as tmp:
        result = os.path.join(tmp, "result.json")
        env = dict(os.environ)
        # One OpenMP thread per rank, as run_llama_train.sh does: 8 ranks on a small machine.
        env.setdefault("OMP_NUM_THREADS", "1")
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={layout.world}",
               script, "--worker", "--result", result, "--dump", tmp,
               *worker_args, "--", *layout.overrides, *overrides]
        proc = subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True)
        if proc.returncode == 0 and os.path.exists(result):
            with open(result) as f:
                return json.load(f)
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-12000:])
        raise RuntimeError(f"{layout.name}: workers failed (exit {proc.returncode})")


def end_worker(trainer) -> None:
    """A worker's last act: close the trainer, meet the other ranks, destroy the groups, then leave at
    once (``os._exit``: the caller still holds the trainer, and nothing after the measurement needs the
    interpreter's teardown)."""
    import logging

    from torchtitan.distributed.lifecycle import shutdown_distributed

    timeout = float(trainer.cfg.comm.train_timeout_seconds)
    trainer.close()
    shutdown_distributed(ok=True, timeout_seconds=timeout)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def build_trainer(dump: str, overrides: Iterable[str]):
    """The project's Trainer for the debug config plus ``overrides`` (what train.py builds)."""
    from torchtitan.config import ConfigManager
    from torchtitan.logging_setup import init_logger
    from torchtitan.trainer import Trainer

    cfg = ConfigManager().parse_args(["--job.config_file", DEBUG_CONFIG, f"--job.dump_folder={dump}",
                                      "--job.print_args=false", *overrides])
    init_logger()
    return Trainer(cfg)


# ---- bytes held per rank ------------------------------------------------------------
def _storage_bytes(t) -> int:
    """Bytes of the storage behind ``t`` (padding included: that is what the rank holds)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    return t.untyped_storage().nbytes()


def state_bytes(model_parts, optimizer) -> dict[str, int]:
    """Parameter, gradient and optimizer-state bytes this rank holds, counting each storage once."""
    import torch

    seen: set[int] = set()

    def count(tensors) -> int:
        total = 0
        for t in tensors:
            if t is None or not isinstance(t, torch.Tensor):
                continue
            from torch.distributed.tensor import DTensor

            local = t.to_local() if isinstance(t, DTensor) else t
            key = local.untyped_storage().data_ptr()
            if key in seen and local.untyped_storage().nbytes() > 0:
                continue
            seen.add(key)
            total += _storage_bytes(local)
        return total

    params = [p for part in model_parts for p in part.parameters()]
    out = {"params": count(params), "grads": count(p.grad for p in params)}
    out["optimizer"] = count(v for state in optimizer.state.values() for v in state.values())
    return out


def full_param_numel(model_parts) -> int:
    return sum(p.numel() for part in model_parts for p in part.parameters())


def peak_rss_bytes() -> int | None:
    """High-water mark of this process's resident memory (VmHWM), Linux only."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# ---- communication counting ------------------------------------------------------------
# Collective kind by the c10d / functional-collective op that carries it. The byte size
# recorded per call is the size of the *full* buffer: the gathered output of an all-gather,
# the input of a reduce-scatter, the tensor of an all-reduce (the "algorithm bytes" that
# nccl-tests report). A ring moves (n - 1) / n of that over each rank's link.
_KIND = {
    "_allgather_base_": "all_gather", "allgather_": "all_gather", "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather", "all_gather_into_tensor_out": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce", "all_reduce_": "all_reduce",
    "send": "send", "recv_": "recv", "recv_any_source_": "recv",
    "broadcast_": "broadcast", "broadcast": "broadcast",
    "alltoall_": "all_to_all", "alltoall_base_": "all_to_all", "all_to_all_single": "all_to_all",
    "barrier": "barrier", "gather_": "gather", "scatter_": "scatter", "reduce_": "reduce",
}
# All-reduces up to this size are latency-bound scalars (token count, loss, grad norm), not
# gradient traffic; they are counted apart so that the byte ratios compare like with like.
SMALL_BYTES = 4096
# Which argument holds the full buffer for each kind (index into the op's positional args).
_FULL_ARG = {"_allgather_base_": 0, "allgather_": 0, "allgather_into_tensor_coalesced_": 0,
             "_reduce_scatter_base_": 1, "reduce_scatter_": 1, "reduce_scatter_tensor_coalesced_": 1}


def _tensor_bytes(obj) -> int:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(o) for o in obj)
    return 0


def group_labels(trainer) -> dict[str, str]:
    """Process-group name -> what the group is for: fsdp, replicate, tp, cp, pp (else its mesh dim).

    Where two purposes share one group, the first in that order names it.
    """
    dims, labels = trainer.dims, {}

    def label(mesh, index: int, name: str) -> None:
        labels.setdefault(mesh.get_group(index).group_name, name)

    from torch.distributed.tensor import DTensor

    # TP's mesh is the one its parameters live on (the tp axis of ParallelDims's dense mesh).
    for part in trainer.model_parts:
        for p in part.parameters():
            names = (p.device_mesh.mesh_dim_names or ()) if isinstance(p, DTensor) else ()
            if "tp" in names:
                label(p.device_mesh, names.index("tp"), "tp")
    for name in ("cp", "pp"):
        mesh = dims.get_mesh(name)
        if mesh is not None:
            label(mesh, 0, name)
    fsdp = dims.fsdp_mesh()
    if fsdp is not None:
        label(fsdp, fsdp.ndim - 1, "fsdp")  # the shard dim is last: (dp_shard_cp) or (dp_replicate, dp_shard)
        if fsdp.ndim == 2:
            label(fsdp, 0, "replicate")
    for name in ("dp_replicate", "dp_shard", "dp", "dp_shard_cp", "dp_cp"):
        mesh = dims.get_mesh(name)
        if mesh is not None:
            label(mesh, 0, name)
    return labels


def _group_of(args, labels: dict[str, str]) -> str:
    """The label of the process group a collective's arguments name ('?' when unknown)."""
    import torch

    for a in args:
        if isinstance(a, torch.ScriptObject):  # c10d ops carry the group boxed
            try:
                a = torch._C._distributed_c10d.ProcessGroup.unbox(a)
            except RuntimeError:  # another boxed argument (a ReduceOp)
                continue
        name = a if isinstance(a, str) else getattr(a, "group_name", None)  # functional ops: its name
        if isinstance(name, str) and name in labels:
            return labels[name]
    return "?"


def make_comm_counter(labels: dict[str, str] | None = None):
    """A TorchDispatchMode that records every collective this rank issues.

    Keys are ``kind@group``, the group named by ``labels`` (see ``group_labels``); values
    hold the calls and bytes.
    """
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class CommCounter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: dict[str, int] = defaultdict(int)
            self.bytes: dict[str, int] = defaultdict(int)
            self.sizes: dict[str, list[int]] = defaultdict(list)  # bytes of each call, in order

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            # Let DTensor desugar its ops first, so that the collectives it issues (e.g. the
            # grad-norm all-reduce) come back through this mode as plain c10d ops.
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented
            if func.namespace in ("c10d", "_c10d_functional", "c10d_functional"):
                name = func._opname
                kind = _KIND.get(name)
                if kind is not None:
                    if name in _FULL_ARG:
                        size = _tensor_bytes(args[_FULL_ARG[name]])
                    elif kind == "all_gather":  # functional: the output is full, the input a shard
                        size = _tensor_bytes(args[0]) * int(args[1] if len(args) > 1 else 1)
                    elif kind == "reduce_scatter":  # functional: the input is full
                        size = _tensor_bytes(args[0])
                    else:
                        size = _tensor_bytes(args[0])
                    if kind == "all_reduce" and size <= SMALL_BYTES:
                        kind = "all_reduce_small"
                    kind = f"{kind}@{_group_of(args, labels or {})}"
                    self.calls[kind] += 1
                    self.bytes[kind] += size
                    self.sizes[kind].append(size)
            return func(*args, **kwargs)

        def summary(self) -> dict[str, dict[str, int]]:
            return {k: {"calls": self.calls[k], "bytes": self.bytes[k], "sizes": self.sizes[k]}
                    for k in sorted(self.calls)}

    return CommCounter()


def wall_clock() -> float:
    return time.perf_counter()
