#!/usr/bin/env python3
"""Print the exact losses (``float.hex``) of a few steps in each layout, to show that a change is bitwise neutral.

    python scripts/loss_fingerprint.py [--repo DIR] [--steps 4] [--layouts single,fsdp2,...] [--json OUT]
                                       [--extra "--model.name=qwen3 --model.flavor=debugmodel_moe ..."]

Each layout trains ``train_configs/debug_model_ci.toml`` of the checkout ``--repo`` (this one by default)
for ``--steps`` steps on the same global batch (4 sequences), through ``torchrun`` (or two replica groups
and a lighthouse for the fault-tolerant layouts), and its rank 0 reports the losses ``Trainer.train()``
returned. ``--extra`` adds trainer options to every layout (another model, an MoE option, activation
checkpointing). Run it on two checkouts and compare the lines: a refactor that claims to change nothing
must print the same hex digits. The float hex is the loss as the trainer computed it (float64), so equal
lines mean bitwise-equal losses, not "close".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
P = "--parallelism."
# layout -> (processes per group, overrides); every layout's global batch is 4 sequences of 32 tokens.
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "single": (1, ["--training.batch_size=4"]),
    "fsdp2": (2, ["--training.batch_size=2", f"{P}data_parallel_shard_degree=2"]),
    "hsdp2x2": (4, ["--training.batch_size=1", f"{P}data_parallel_replicate_degree=2",
                    f"{P}data_parallel_shard_degree=2"]),
    "tp2": (2, ["--training.batch_size=4", f"{P}tensor_parallel_degree=2", f"{P}data_parallel_shard_degree=1"]),
    "cp2": (2, ["--training.batch_size=4", f"{P}context_parallel_degree=2", f"{P}data_parallel_shard_degree=1"]),
    "pp2": (2, ["--training.batch_size=4", f"{P}pipeline_parallel_degree=2", f"{P}data_parallel_shard_degree=1",
                f"{P}pipeline_parallel_microbatches=2"]),
    # Two replica groups of one rank each, each reading half of the global batch.
    "ft": (1, ["--training.batch_size=2", "--fault_tolerance.enable", "--fault_tolerance.num_replica_groups=2"]),
    "diloco": (1, ["--training.batch_size=2", "--fault_tolerance.enable", "--fault_tolerance.num_replica_groups=2",
                   "--fault_tolerance.semi_sync_method=diloco", "--fault_tolerance.sync_steps=2"]),
}


def worker(argv: list[str], out: str) -> None:
    """Train in this process (one rank of a launch) and let the reporting rank write the losses."""
    from torchtitan.config import ConfigManager
    from torchtitan.logging_setup import init_logger
    from torchtitan.trainer import Trainer

    cfg = ConfigManager().parse_args(argv)
    init_logger()
    trainer = Trainer(cfg)
    losses = trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:
        Path(out).write_text(json.dumps([float(x).hex() for x in losses]))
    del trainer
    from torchtitan.distributed.lifecycle import shutdown_distributed

    shutdown_distributed(ok=True, timeout_seconds=60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(repo: Path, nproc: int, args: list[str], out: Path, log: Path, env: dict[str, str]) -> subprocess.Popen:
    cmd = [sys.executable, str(HERE), "--worker", str(out), *args]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(HERE), "--worker", str(out), *args]
    return subprocess.Popen(cmd, cwd=repo, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def run_layout(repo: Path, name: str, steps: int, tmp: Path, extra: list[str] | None = None) -> list[str]:
    nproc, overrides = LAYOUTS[name]
    base = [f"--job.config_file={repo / 'train_configs' / 'debug_model_ci.toml'}", f"--training.steps={steps}",
            "--metrics.enable_tensorboard=false", *overrides, *(extra or [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo)}
    if not name.startswith(("ft", "diloco")):
        out = tmp / f"{name}.json"
        proc = _launch(repo, nproc, [*base, f"--job.dump_folder={tmp / name}"], out, tmp / f"{name}.log", env)
        if proc.wait(timeout=900):
            raise SystemExit(f"{name} failed:\n{(tmp / f'{name}.log').read_text()[-3000:]}")
        return json.loads(out.read_text())
    port = _free_port()
    lighthouse = subprocess.Popen(
        [shutil.which("torchft_lighthouse") or "torchft_lighthouse", "--min_replicas=2", f"--bind=[::]:{port}",
         "--join_timeout_ms=1000", "--quorum_tick_ms=50"],
        stdout=open(tmp / f"{name}_lighthouse.log", "w"), stderr=subprocess.STDOUT)
    try:
        time.sleep(0.5)
        procs = [
            _launch(repo, nproc, [*base, f"--job.dump_folder={tmp / name / str(g)}",
                                  f"--fault_tolerance.replica_id={g}",
                                  f"--fault_tolerance.lighthouse=http://localhost:{port}"],
                    tmp / f"{name}{g}.json", tmp / f"{name}{g}.log", env)
            for g in range(2)
        ]
        for g, proc in enumerate(procs):
            if proc.wait(timeout=900):
                raise SystemExit(f"{name} group {g} failed:\n{(tmp / f'{name}{g}.log').read_text()[-3000:]}")
    finally:
        lighthouse.kill()
    groups = [json.loads((tmp / f"{name}{g}.json").read_text()) for g in range(2)]
    if name == "diloco":  # between syncs each group logs its own loss: report both, group 0's first
        return groups[0] + ["|"] + groups[1]
    if groups[0] != groups[1]:
        raise SystemExit(f"{name}: the two replica groups logged different losses: {groups}")
    return groups[0]


def main() -> int:
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[3:], sys.argv[2])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=HERE.parents[1], help="checkout to train (default: this one)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--json", type=Path, help="also write {layout: [hex losses]} here")
    parser.add_argument("--extra", default="", help="more trainer options for every layout, space-separated")
    args = parser.parse_args()
    names = [n for n in args.layouts.split(",") if n]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layout(s) {unknown}; choose from {', '.join(LAYOUTS)}")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            results[name] = run_layout(args.repo.resolve(), name, args.steps, Path(tmp), args.extra.split())
            print(f"{name:8s} {' '.join(results[name])}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
