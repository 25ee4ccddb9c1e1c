"""Cross-group bytes per step: fault-tolerant HSDP (an all-reduce every step) against DiLoCo and LocalSGD.

    python benchmarks/semi_sync_bytes.py [--steps 16] [--shard 1|2]

For each mode, two replica groups (one rank each, or FSDP ``--shard`` ranks under torchrun)
train the CI debug model for ``--steps`` steps with a lighthouse. The figures are measured:
``tests/fault_tolerance/ft_entry.py`` adds up the bytes of every tensor each rank hands to
torchft's cross-group all-reduce (``Manager.allreduce``) per step. That is what one rank
contributes to the all-reduce; on the wire a ring all-reduce over G groups moves
2(G-1)/G times as much per rank. The replica check is off, so nothing else is counted.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from torchtitan.distributed.lifecycle import free_port  # noqa: E402

ENTRY = str(REPO / "tests" / "fault_tolerance" / "ft_entry.py")
CONFIG = str(REPO / "train_configs" / "debug_model_ci.toml")
MODES = {
    "none (HSDP: all-reduce every step)": [],
    "diloco, sync_steps 4": ["--fault_tolerance.semi_sync_method=diloco", "--fault_tolerance.sync_steps=4"],
    "diloco, sync_steps 4, 2 fragments": ["--fault_tolerance.semi_sync_method=diloco",
                                          "--fault_tolerance.sync_steps=4", "--fault_tolerance.num_fragments=2"],
    "diloco, sync_steps 16": ["--fault_tolerance.semi_sync_method=diloco", "--fault_tolerance.sync_steps=16"],
    "local_sgd, sync_steps 4": ["--fault_tolerance.semi_sync_method=local_sgd", "--fault_tolerance.sync_steps=4"],
}


def _group(tmp: Path, g: int, port: int, steps: int, shard: int, extra: list[str]) -> subprocess.Popen:
    launcher = [sys.executable, ENTRY] if shard == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={shard}", ENTRY]
    args = [f"--job.config_file={CONFIG}", f"--training.steps={steps}", "--training.batch_size=1",
            "--metrics.enable_tensorboard=false", f"--parallelism.data_parallel_shard_degree={shard}",
            "--fault_tolerance.enable", "--fault_tolerance.num_replica_groups=2", "--fault_tolerance.min_replicas=2",
            f"--fault_tolerance.replica_id={g}", f"--fault_tolerance.lighthouse=http://localhost:{port}",
            f"--job.dump_folder={tmp / f'g{g}'}", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FT_RECORD": str(tmp / f"g{g}"),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([*launcher, *args], env=env, stdout=open(tmp / f"g{g}.log", "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def measure(extra: list[str], steps: int, shard: int) -> tuple[float, int]:
    """(mean bytes per step handed to torchft by rank 0 of group 0, number of steps that sent any)."""
    with tempfile.TemporaryDirectory() as d:
        tmp, port = Path(d), free_port()
        lighthouse = subprocess.Popen(["torchft_lighthouse", "--min_replicas=2", f"--bind=[::]:{port}",
                                       "--join_timeout_ms=1000", "--quorum_tick_ms=50"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
        procs = [_group(tmp, g, port, steps, shard, extra) for g in (0, 1)]
        try:
            codes = [p.wait(timeout=600) for p in procs]
        finally:
            for p in [*procs, lighthouse]:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            lighthouse.wait()
        if codes != [0, 0]:
            raise SystemExit(f"a group failed ({codes}):\n{(tmp / 'g0.log').read_text()[-3000:]}")
        records = [json.loads(line) for line in (tmp / "g0.0").read_text().splitlines()]
    sent = [r["allreduce_bytes"] for r in records]
    return sum(sent) / len(sent), sum(1 for b in sent if b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--shard", type=int, default=1, help="FSDP ranks per group (torchrun when > 1)")
    a = parser.parse_args()
    rows = [(name, *measure(extra, a.steps, a.shard)) for name, extra in MODES.items()]
    base = rows[0][1]
    print(f"| mode ({a.steps} steps, {a.shard} rank(s) per group) | bytes per step per rank | steps that sent | "
          "vs HSDP |\n|---|---|---|---|")
    for name, per_step, sending in rows:
        print(f"| {name} | {per_step:,.0f} | {sending} of {a.steps} | {per_step / base:.3f} |")


if __name__ == "__main__":
    main()
