"""Muon against AdamW on held-out loss: the debug model trained with each optimizer at a few learning rates.

Each run is one ``train.py`` process on the debug config (same seed, data order and LR schedule; only
``--optimizer.name`` and ``--optimizer.lr`` differ), validating on a held-out split of its training data
(docs/validation.md) every ``--eval-every`` steps and after the last. Each optimizer's best learning rate is
the one with the lowest final held-out loss. The gain is the training tokens AdamW's best run needs to reach
Muon's best final held-out loss (first crossing, linearly interpolated between evaluations) over the tokens
Muon trained: above 1, Muon reached the loss on fewer tokens. With ``--extend-steps``, an AdamW run that never
reaches it is trained again for that many steps to find the crossing. benchmarks/README.md §34 has the figures.

    OMP_NUM_THREADS=1 python benchmarks/muon_gain.py --out outputs/muon_gain.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import TypedDict

from common import DEBUG_CONFIG, REPO, load_average, machine_description

from torchtitan.metrics.logger import VALIDATION_LINE

TRAINED_TOKENS = re.compile(r"trained on: ([\d,]+) tokens")


class Run(TypedDict):
    optimizer: str
    lr: float
    steps: int
    curve: list[tuple[int, float]]  # (training tokens seen, held-out loss), one per evaluation
    final: float
    seconds: float


class Gain(TypedDict):
    best_adamw_lr: float
    best_muon_lr: float
    target: float  # Muon's best final held-out loss
    muon_tokens: int
    adamw_steps_searched: int
    adamw_tokens: float | None  # None: AdamW's best never reached the target
    ratio: float | None  # adamw_tokens / muon_tokens
    ratio_above: float | None  # when never reached: the ratio is above this bound


def read_curve(log: str) -> list[tuple[int, float]]:
    """(training tokens seen, held-out loss) of every ``validation step:`` line rank 0 printed, in order."""
    curve = []
    for line in log.splitlines():
        match = VALIDATION_LINE.search(line)
        tokens = TRAINED_TOKENS.search(line)
        if match and tokens and match.group(1) == "0":
            curve.append((int(tokens.group(1).replace(",", "")), float(match.group(3))))
    return curve


def tokens_to_reach(curve: list[tuple[int, float]], target: float) -> float | None:
    """The training tokens at which ``curve`` first falls to ``target``, linear between evaluations; None if never.

    Reached at the first evaluation already, that evaluation's tokens are returned: an upper bound.
    """
    for i, (tokens, loss) in enumerate(curve):
        if loss > target:
            continue
        if i == 0:
            return float(tokens)
        before_tokens, before_loss = curve[i - 1]
        return before_tokens + (before_loss - target) / (before_loss - loss) * (tokens - before_tokens)
    return None


def train(optimizer: str, lr: float, steps: int, args: argparse.Namespace, log: Path) -> Run:
    """One ``train.py`` run; its output is appended to ``log``."""
    dump = Path(args.out).with_suffix("") / f"{optimizer}_{lr:g}_{steps}"
    cmd = [sys.executable, str(REPO / "train.py"), "--job.config_file", DEBUG_CONFIG, f"--job.dump_folder={dump}",
           f"--training.steps={steps}", f"--optimizer.name={optimizer}", f"--optimizer.lr={lr}",
           f"--lr_scheduler.warmup_steps={args.warmup}", "--validation.enable",
           f"--validation.held_out_fraction={args.held_out_fraction}", f"--validation.freq={args.eval_every}",
           f"--metrics.log_freq={args.eval_every}", "--metrics.enable_tensorboard=false", *args.overrides]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    with log.open("a") as f:
        f.write(f"==== {optimizer} lr {lr:g}, {steps} steps: exit {proc.returncode}, {seconds:.0f} s\n"
                f"{' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
    curve = read_curve(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not curve:
        raise RuntimeError(f"{optimizer} lr {lr:g}: train.py exited {proc.returncode} with {len(curve)} "
                           f"validation line(s); its output is in {log}")
    return Run(optimizer=optimizer, lr=lr, steps=steps, curve=curve, final=curve[-1][1], seconds=seconds)


def gain(runs: list[Run], steps: int) -> Gain:
    """Each optimizer's best run at ``steps`` and the token ratio AdamW / Muon to Muon's best final loss."""
    def best(name: str) -> Run:
        return min((r for r in runs if r["optimizer"] == name and r["steps"] == steps), key=lambda r: r["final"])

    adamw, muon = best("AdamW"), best("Muon")
    muon_tokens = muon["curve"][-1][0]
    longest = max((r for r in runs if r["optimizer"] == "AdamW" and r["lr"] == adamw["lr"]), key=lambda r: r["steps"])
    reached = tokens_to_reach(longest["curve"], muon["final"])
    return Gain(best_adamw_lr=adamw["lr"], best_muon_lr=muon["lr"], target=muon["final"], muon_tokens=muon_tokens,
                adamw_steps_searched=longest["steps"], adamw_tokens=reached,
                ratio=None if reached is None else reached / muon_tokens,
                ratio_above=longest["curve"][-1][0] / muon_tokens if reached is None else None)


def report(result: dict) -> str:
    lines = ["| optimizer | lr | steps | final held-out loss | wall s |", "|---|---|---|---|---|"]
    lines += [f"| {r['optimizer']} | {r['lr']:g} | {r['steps']} | {r['final']:.4f} | {r['seconds']:.0f} |"
              for r in result["runs"]]
    g = result.get("gain")
    if g:
        ratio = f"{g['ratio']:.3f}" if g["ratio"] is not None else f"> {g['ratio_above']:.2f} (never reached)"
        lines.append(f"best AdamW lr {g['best_adamw_lr']:g}, best Muon lr {g['best_muon_lr']:g}; AdamW tokens to "
                     f"Muon's final {g['target']:.4f} / Muon's {g['muon_tokens']:,} tokens: {ratio}")
    return "\n".join(lines)


def parse_lrs(text: str, option: str, parser: argparse.ArgumentParser) -> list[float]:
    try:
        lrs = [float(x) for x in text.split(",")]
    except ValueError:
        lrs = []
    if not lrs or any(not lr > 0 for lr in lrs):
        parser.error(f"{option}: '{text}' is not a comma-separated list of positive learning rates, e.g. 3e-4,1e-3")
    return lrs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lrs-adamw", default="3e-4,1e-3,3e-3")
    parser.add_argument("--lrs-muon", default="3e-4,1e-3,3e-3")
    parser.add_argument("--eval-every", type=int, default=25, help="validate every this many steps")
    parser.add_argument("--warmup", type=int, default=20, help="LR warmup steps, the same for every run")
    parser.add_argument("--held-out-fraction", type=float, default=0.02)
    parser.add_argument("--extend-steps", type=int, default=0,
                        help="if AdamW's best never reaches Muon's final loss, train it again this long (0: no)")
    parser.add_argument("--out", default="outputs/muon_gain.json", help="the JSON; the log goes beside it (.log)")
    parser.add_argument("overrides", nargs="*", help="extra train.py overrides for every run, after --")
    args = parser.parse_args(argv)
    args.adamw, args.muon = (parse_lrs(args.lrs_adamw, "--lrs-adamw", parser),
                             parse_lrs(args.lrs_muon, "--lrs-muon", parser))
    if args.steps < 1 or args.eval_every < 1:
        parser.error(f"--steps {args.steps} / --eval-every {args.eval_every}: both must be at least 1")
    if args.extend_steps and args.extend_steps <= args.steps:
        parser.error(f"--extend-steps {args.extend_steps}: must exceed --steps {args.steps} (or be 0)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.with_suffix(".log")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    result: dict = {"machine": machine_description(), "commit": commit.stdout.strip(), "load_before": load_average(),
                    "argv": sys.argv[1:], "runs": []}
    for optimizer, lrs in (("AdamW", args.adamw), ("Muon", args.muon)):
        for lr in lrs:
            result["runs"].append(train(optimizer, lr, args.steps, args, log))
            out.write_text(json.dumps(result, indent=1))  # progress survives a stopped benchmark
            print(report(result).splitlines()[-1], flush=True)
    result["gain"] = gain(result["runs"], args.steps)
    if result["gain"]["adamw_tokens"] is None and args.extend_steps:
        result["runs"].append(train("AdamW", result["gain"]["best_adamw_lr"], args.extend_steps, args, log))
        result["gain"] = gain(result["runs"], args.steps)
    result["load_after"] = load_average()
    out.write_text(json.dumps(result, indent=1))
    print(f"machine: {result['machine']}; commit {result['commit']}; load {result['load_before']} -> "
          f"{result['load_after']}\n{report(result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
