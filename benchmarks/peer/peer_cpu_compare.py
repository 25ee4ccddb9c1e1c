"""Step time of the project against TorchTitan 0.3.0 on CPU (gloo, FSDP, float32), run in alternation.

    # once: the peer in a folder of its own, never into this environment (and never in CI)
    echo torch==2.13.0 > /tmp/torch-pin.txt
    pip install --target /work/peer-site -c /tmp/torch-pin.txt --no-deps torchtitan==0.3.0 \
        spmd_types==0.2.3 torch_checkpointing tyro einops docstring_parser typeguard
    # then (about 45 minutes on 2 cores with the default 2 pairs per shape)
    python benchmarks/peer/peer_cpu_compare.py --peer-site /work/peer-site

The peer needs only those packages beyond what this project installs (``torchdata``,
``datasets``, ``tokenizers``, ``safetensors``, ``tensorboard``); ``--no-deps`` plus the torch
pin keep pip from replacing torch.

For each shape (tokens per rank per step) and rank count, the driver runs project / peer pairs,
project first in odd pairs and peer first in even ones, each run its own ``torchrun``. Both sides
train the debug model (the project's shape: untied, GQA 16/8, no RoPE scaling) from the same
initial weights on the same token windows with the same learning rate at every step
(``peer_cpu_assets.py``, ``peer_cpu.py``). A step's time runs from the start of one step to the
start of the next (data loading, logging and everything else of the loop included), as wall
seconds on rank 0 and CPU seconds summed over the ranks; the table gives the medians after
warm-up (the last step is left out: the peer sleeps 2 s after it). The first run also checks the
two sides step by step: learning rate equal, losses and grad norms within ``--loss-tol``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# benchmarks/ for common.py (the driver and its torchrun workers start in benchmarks/peer/).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import REPO, load_average, machine_description
from peer_cpu_assets import dump_windows, prepare

PEER_VERSION = "0.3.0"
# (ranks, batch, seq, steps, warm-up): 8 ranks on 2 cores are slow at 8 x 2048, so few steps there.
SHAPES = [(2, 1, 64, 40, 5), (2, 8, 256, 50, 5), (2, 8, 2048, 12, 3),
          (8, 1, 64, 25, 5), (8, 8, 256, 12, 3), (8, 8, 2048, 5, 1)]
WARMUP_STEPS, LR_MIN = 2, 0.1  # train_configs/debug_model.toml


# ---- the project's side (worker) ------------------------------------------------
def project_overrides(work: Path, batch: int, seq: int, steps: int) -> list[str]:
    from peer_cpu import project_decay_ratio

    return [f"--training.batch_size={batch}", f"--training.seq_len={seq}", f"--training.steps={steps}",
            f"--training.dataset_path={work / 'store'}",
            f"--model.tokenizer_path={work / 'tokenizer' / 'tokenizer.json'}",
            f"--checkpoint.initial_load_path={work / 'init_hf'}", "--checkpoint.initial_load_format=hf",
            f"--lr_scheduler.warmup_steps={WARMUP_STEPS}", f"--lr_scheduler.lr_min={LR_MIN}",
            f"--lr_scheduler.decay_ratio={project_decay_ratio(WARMUP_STEPS, steps)!r}",
            "--metrics.enable_tensorboard=false", "--job.print_args=false",
            "--model.attn_mask_type=causal"]  # the peer's CPU attention is causal SDPA (peer_cpu.build_model_spec)


def project_worker(args: argparse.Namespace) -> None:
    """One rank of the project's trainer; stamps every step like ``peer_cpu.instrument``."""
    import torch
    from common import build_trainer, end_worker
    from peer_cpu import stamp

    windows = torch.load(args.windows)
    steps, batch, seq = windows.shape[0], windows.shape[2], windows.shape[3] - 1
    out = Path(args.out)
    trainer = build_trainer(str(out / "project_out"), project_overrides(Path(args.work), batch, seq, steps))
    records = instrument(trainer, windows)
    with _maybe_profile(args.profile_dir, trainer.rank, out / "project_profile.txt"):
        trainer.train()
    records.append(stamp())
    (out / f"project_rank{trainer.rank}.json").write_text(json.dumps(records))
    end_worker(trainer)


def instrument(trainer, windows) -> list[dict]:
    """The records of ``trainer``'s steps, filled as it trains: a ``peer_cpu.stamp`` and the lr at each step's
    start (before its data is read), its loss and grad norm when it logs (the debug config logs every step).
    Each step's micro-batches must be the windows the peer is given (``windows[step, rank]``).

    Wraps the step strategy's ``next_step`` (the step from its data on) and ``run`` (the step over its
    batches), and the trainer's ``_log``: the trainer's loop itself is unchanged.
    """
    from peer_cpu import stamp

    from torchtitan.batch import Batch

    strategy, rank, records = trainer.step_strategy, trainer.rank, []
    next_step, run, log = strategy.next_step, strategy.run, trainer._log

    def timed_step(step, loaded=None):
        records.append({**stamp(), "lr": trainer.lr_scheduler.get_last_lr()[0]})
        return next_step(step, loaded)

    def checked_run(batches, step):
        window = windows[len(records) - 1, rank]
        for item in batches:
            b = Batch.of(item)
            if not (b.inputs.equal(window[:, :-1]) and b.labels.equal(window[:, 1:])):
                raise AssertionError(f"step {step}: the project's loader and the dumped windows disagree")
        return run(batches, step)

    def timed_log(loss, now, lr, scores):
        records[-1].update(loss=float(loss), grad_norm=float(now["grad_norm"]))
        return log(loss, now, lr, scores)

    strategy.next_step, strategy.run, trainer._log = timed_step, checked_run, timed_log
    return records


def _maybe_profile(folder: str | None, rank: int, path: Path):
    import contextlib

    if not folder or rank != 0:
        return contextlib.nullcontext()
    from peer_cpu import ProfileToFile

    return ProfileToFile(path)


# ---- the driver -----------------------------------------------------------------
def launch(side: str, ranks: int, windows: Path, out: Path, args: argparse.Namespace, profile: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob(f"{side}_rank*.json"):
        old.unlink()  # a failed run must not leave the previous run's records behind
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    port = str(29500 + (os.getpid() + int(time.time())) % 2000)
    if side == "project":
        script = [str(Path(__file__)), "--worker", "--work", str(args.work)]
        env["PYTHONPATH"] = str(REPO)
    else:
        script = [str(Path(__file__).with_name("peer_torchtitan.py")), "--device", "cpu", "--assets", str(args.work),
                  "--init-hf", str(Path(args.work).resolve() / "init_hf"),
                  "--warmup-steps", str(WARMUP_STEPS), "--lr-min", str(LR_MIN)]
        env["PEER_SITE"] = str(args.peer_site)
        env.pop("PYTHONPATH", None)  # the project's package must not shadow the peer's
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", f"--master_port={port}",
           *script, "--windows", str(windows), "--out", str(out)] + (["--profile-dir", str(out)] if profile else [])
    with open(out / f"{side}.log", "w") as log:
        proc = subprocess.run(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"{side} run failed ({proc.returncode}); see {out / f'{side}.log'}")


def read_run(out: Path, side: str, ranks: int, warmup: int) -> dict:
    """Per-step medians after warm-up: wall (rank 0); CPU, kernel CPU and page faults summed over ranks; the trace."""
    per_rank = [json.loads((out / f"{side}_rank{r}.json").read_text()) for r in range(ranks)]
    n = len(per_rank[0]) - 1  # steps; the last record is the end stamp
    wall = [per_rank[0][i + 1]["wall"] - per_rank[0][i]["wall"] for i in range(n)]
    summed = {key: [sum(rec[i + 1][key] - rec[i][key] for rec in per_rank) for i in range(n)]
              for key in ("cpu", "sys", "minflt")}
    timed = slice(warmup, n - 1)  # the last step: the peer sleeps 2 s after it
    trace = [{k: per_rank[0][i].get(k) for k in ("loss", "grad_norm", "lr")} for i in range(n)]
    return {"wall": statistics.median(wall[timed]), **{k: statistics.median(v[timed]) for k, v in summed.items()},
            "steps_timed": len(wall[timed]), "trace": trace}


def compare_traces(project: list[dict], peer: list[dict]) -> dict:
    """Largest relative gaps of loss and grad norm, and of the learning rate, over the steps."""
    def gap(key: str) -> float:
        return max(abs(a[key] - b[key]) / abs(b[key]) for a, b in zip(project, peer))

    return {"loss_rel": gap("loss"), "grad_norm_rel": gap("grad_norm"), "lr_rel": gap("lr"),
            "loss_at": {s: (project[s - 1]["loss"], peer[s - 1]["loss"]) for s in (1, 10, 50) if s <= len(peer)}}


def run_pair(shape: tuple, pair: int, args: argparse.Namespace) -> dict:
    """One project run and one peer run of ``shape``, the project first in odd pairs."""
    ranks, batch, seq, steps, warmup = shape
    windows = dump_windows(Path(args.work), ranks, batch, seq, steps)
    order = ["project", "peer"] if pair % 2 == 1 else ["peer", "project"]
    result = {}
    for side in order:
        out = Path(args.work) / "runs" / f"{ranks}x{batch}x{seq}" / f"pair{pair}"
        launch(side, ranks, windows, out, args, profile=args.profile)
        result[side] = read_run(out, side, ranks, warmup)
    result["load_average"] = load_average()
    result["check"] = compare_traces(result["project"]["trace"], result["peer"]["trace"])
    return result


def summarize(pairs: list[dict]) -> dict:
    """Medians over the pairs of each side's medians; ratios project / peer."""
    med = {side: {k: statistics.median(p[side][k] for p in pairs) for k in ("wall", "cpu")}
           for side in ("project", "peer")}
    return {**med, "wall_ratio": med["project"]["wall"] / med["peer"]["wall"],
            "cpu_ratio": med["project"]["cpu"] / med["peer"]["cpu"],
            "pair_wall_ratios": [p["project"]["wall"] / p["peer"]["wall"] for p in pairs],
            "load_averages": [p["load_average"] for p in pairs],
            "steps_timed": pairs[0]["project"]["steps_timed"], "check": pairs[0]["check"]}


def print_row(shape: tuple, s: dict) -> None:
    ranks, batch, seq, steps, warmup = shape
    c = s["check"]
    print(f"{ranks:5d} {batch:>3d} x {seq:<5d} {s['project']['wall']:9.4f} {s['peer']['wall']:9.4f} "
          f"{s['wall_ratio']:6.3f} {s['project']['cpu']:9.4f} {s['peer']['cpu']:9.4f} {s['cpu_ratio']:6.3f} "
          f"{steps:3d}/{warmup}/{s['steps_timed']:<3d} {c['loss_rel']:8.1e} {c['lr_rel']:7.1e}  "
          f"{' '.join(f'{r:.3f}' for r in s['pair_wall_ratios'])}  {s['load_averages'][-1]}", flush=True)


def parse_shapes(text: str | None, steps: int | None, warmup: int | None) -> list[tuple]:
    """The shapes asked for (default: all), with the steps and warm-up overridden when given."""
    wanted = [tuple(int(v) for v in item.split("x")) for item in text.split(",")] if text else None
    return [(*s[:3], steps or s[3], warmup if warmup is not None else s[4])
            for s in SHAPES if wanted is None or s[:3] in wanted]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peer-site", default=os.environ.get("PEER_SITE", "/work/peer-site"),
                   help="the folder the peer was installed into (pip --target)")
    p.add_argument("--work", default="/tmp/peer_cpu_compare", help="assets and run folders (reused)")
    p.add_argument("--shapes", help="ranks x batch x seq, comma separated (default: all six)")
    p.add_argument("--steps", type=int, help="steps of every run (default: per shape, see SHAPES)")
    p.add_argument("--warmup", type=int, help="steps left out of the medians (default: per shape)")
    p.add_argument("--pairs", type=int, default=2, help="project/peer pairs per shape")
    p.add_argument("--profile", action="store_true", help="torch.profiler table of rank 0 per run")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--windows", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--profile-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        project_worker(args)
        return
    args.work = str(Path(args.work).resolve())
    prepare(Path(args.work))
    print(f"machine: {machine_description()}; peer: torchtitan {PEER_VERSION}; load average before: "
          f"{load_average()}", flush=True)
    print("ranks tokens/rank  wall s/step (project, peer, ratio)  CPU s/step (project, peer, ratio)  "
          "steps/warm-up/timed  max loss gap  lr gap  pair wall ratios  load average", flush=True)
    results = {}
    for shape in parse_shapes(args.shapes, args.steps, args.warmup):
        pairs = [run_pair(shape, i + 1, args) for i in range(args.pairs)]
        results["x".join(map(str, shape[:3]))] = s = summarize(pairs)
        print_row(shape, s)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
