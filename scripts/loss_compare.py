#!/usr/bin/env python3
"""Compare the loss curves of test runs with a trusted control, step by step.

Run the jobs (through run_llama_train.sh, one after the other):

    python scripts/loss_compare.py --steps 200 --ngpu 8 \\
        --control "--parallelism.data_parallel_shard_degree 8" \\
        --test "--parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 4" \\
        --test "--parallelism.data_parallel_shard_degree 4 --parallelism.tensor_parallel_degree 2 \\
                --training.batch_size 2" \\
        --plot compare.png

A finished control can be reused for new tests with ``--control-from DUMP`` (it must
have been trained with the same --steps and config). Or read runs made earlier (their
dump folders; the first is the control):

    python scripts/loss_compare.py --from-logs outputs/control outputs/hsdp [...] --plot compare.png

Per-step losses come from each run's TensorBoard events. The script prints a table
(step, control, each test and its relative difference |test - control| / |control|), a
summary per test, and with ``--plot`` writes a PNG of the curves and of the relative
differences (needs matplotlib: ``pip install -e .[plot]``). ``--metric validation/loss``
compares the validation curves instead (runs with ``validation.enable``), at the steps
that validated; a test missing one of the control's validation steps fails.

It refuses (exit 2) to compare runs whose global batch (sequences per optimizer step)
or tokens per step differ: such curves differ for reasons that have nothing to do
with the parallelism under test. It warns when the seed, data, model or schedule
differ. Exit status: 0 when every test stays within ``--tolerance`` at every step,
1 when one leaves it (or stops early), 2 when the runs cannot be compared or failed.
See docs/converging.md for the method; measured results are in benchmarks/README.md section 14.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: import the package of this checkout
# The trainer's own statement of the batch arithmetic, the most reliable source when a log exists.
from torchtitan.metrics.logger import BATCH_LINE  # noqa: E402

LAUNCHER = REPO / "run_llama_train.sh"
DEFAULT_CONFIG = REPO / "train_configs" / "debug_model.toml"
LOG_NAME = "train.log"
# Settings that make two curves differ legitimately or by accident: reported, not refused.
WARN_KEYS = [("training", "seed"), ("training", "dataset"), ("training", "dataset_path"), ("model", "flavor"),
             ("model", "tokenizer_path"), ("optimizer", "lr"), ("lr_scheduler", "warmup_steps"),
             ("training", "mixed_precision_param"),
             # The lr schedule decays over training.steps: another step count is another schedule.
             ("training", "steps"),
             # Holding documents out changes the training data too.
             ("validation", "held_out_fraction"), ("validation", "split_seed")]
# With --metric validation/loss: what decides which data is evaluated.
VALIDATION_WARN_KEYS = [("validation", "dataset"), ("validation", "dataset_path"), ("validation", "steps"),
                        ("validation", "batch_size")]
METRICS = ("loss", "validation/loss", "validation/perplexity")


class CompareError(Exception):
    """The runs cannot be compared (or could not be produced); exit status 2."""


@dataclasses.dataclass
class RunData:
    label: str
    dump: Path
    losses: dict[int, float]  # step -> loss
    config: dict
    global_batch: int
    seq_len: int
    batch_source: str  # where global_batch came from, for the report

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len


# ---------------------------------------------------------------------------------------
# Reading a run
# ---------------------------------------------------------------------------------------
def read_losses(tb_dir: Path, metric: str = "loss") -> dict[int, float]:
    """step -> ``metric`` from every TensorBoard event file under ``tb_dir`` (later files win on a step)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(tb_dir.glob("**/events.out.tfevents.*"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise CompareError(f"no TensorBoard events under {tb_dir} (was metrics.enable_tensorboard on?)")
    losses: dict[int, float] = {}
    for path in files:
        acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
        acc.Reload()
        if metric in acc.Tags()["scalars"]:
            losses.update({e.step: float(e.value) for e in acc.Scalars(metric)})
    if not losses:
        hint = " (was validation.enable on?)" if metric.startswith("validation/") else ""
        raise CompareError(f"the TensorBoard events under {tb_dir} hold no '{metric}' scalar{hint}")
    return losses


def global_batch_of(config: dict, dump: Path, world_size: int | None) -> tuple[int, str]:
    """Sequences per optimizer step over all ranks, and how it was found."""
    # This script's train.log first, then any other log kept in the folder (the integration matrix's phase logs).
    for log in sorted(dump.glob("*.log"), key=lambda path: path.name != LOG_NAME):
        match = BATCH_LINE.search(log.read_text(errors="replace"))
        if match:
            local, _, accum, dp = (int(g) for g in match.groups())
            return local * accum * dp, f"{log.name}: local batch {local} x {accum} micro-step(s) x dp {dp}"
    t, p = config["training"], config["parallelism"]
    if t.get("global_batch_size", -1) != -1:
        return int(t["global_batch_size"]), "config: training.global_batch_size"
    shard = int(p["data_parallel_shard_degree"])
    replicate = int(p["data_parallel_replicate_degree"])
    if shard == -1:
        others = replicate * int(p.get("context_parallel_degree", 1)) * int(p.get("tensor_parallel_degree", 1)) \
            * int(p.get("pipeline_parallel_degree", 1))
        if world_size is None:
            raise CompareError(f"{dump}: data_parallel_shard_degree = -1 and no log to read the dp degree from; "
                               "pass --ngpu with the run's number of ranks")
        shard = world_size // others
    dp = replicate * shard
    accum = int(t.get("gradient_accumulation_steps", 1))
    return int(t["batch_size"]) * dp * accum, f"config: batch_size {t['batch_size']} x dp {dp} x accum {accum}"


def load_run(label: str, dump: Path, world_size: int | None, metric: str = "loss") -> RunData:
    config_path = dump / "config.toml"
    if not config_path.is_file():
        raise CompareError(f"{dump}: no config.toml (not a dump folder of a training run?)")
    config = tomllib.loads(config_path.read_text())
    tb_dir = dump / config["metrics"].get("save_tb_folder", "tb")
    losses = read_losses(tb_dir, metric)
    batch, source = global_batch_of(config, dump, world_size)
    return RunData(label, dump, losses, config, batch, int(config["training"]["seq_len"]), source)


# ---------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------
def launch(label: str, overrides: list[str], ranks: int, args: argparse.Namespace, dump: Path) -> None:
    """Train one run into ``dump`` with TensorBoard on at every step; raise CompareError if it fails."""
    if dump.exists() and any(dump.iterdir()):
        raise CompareError(f"{dump} is not empty: choose another --output-dir (old events would be read back)")
    dump.mkdir(parents=True, exist_ok=True)
    argv = ["bash", str(LAUNCHER), f"--job.dump_folder={dump}", f"--training.steps={args.steps}",
            "--metrics.enable_tensorboard", "--metrics.log_freq=1", *overrides]
    env = {**os.environ, "NGPU": str(ranks), "CONFIG_FILE": str(args.config), "LOG_RANK": "0"}
    print(f"[run] {label} on {ranks} ranks: {shlex.join(overrides) or '(config as is)'}", flush=True)
    start = time.monotonic()
    with open(dump / LOG_NAME, "w") as log:
        rc = subprocess.run(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    print(f"[run] {label}: exit {rc} after {time.monotonic() - start:.0f} s; log {dump / LOG_NAME}", flush=True)
    if rc != 0:
        tail = "\n".join((dump / LOG_NAME).read_text(errors="replace").splitlines()[-20:])
        raise CompareError(f"{label} failed (exit {rc}):\n{tail}")


# ---------------------------------------------------------------------------------------
# Comparing
# ---------------------------------------------------------------------------------------
def check_comparable(control: RunData, tests: list[RunData], metric: str = "loss") -> list[str]:
    """Raise CompareError if a test's global batch or tokens per step differ; return warnings."""
    refusals, warnings = [], []
    for test in tests:
        if test.global_batch != control.global_batch or test.tokens_per_step != control.tokens_per_step:
            refusals.append(
                f"{test.label}: global batch {test.global_batch} x seq {test.seq_len} = {test.tokens_per_step} "
                f"tokens/step ({test.batch_source}) but {control.label}: {control.global_batch} x "
                f"{control.seq_len} = {control.tokens_per_step} ({control.batch_source})")
        for section, key in WARN_KEYS + (VALIDATION_WARN_KEYS if metric.startswith("validation/") else []):
            a = control.config.get(section, {}).get(key)
            b = test.config.get(section, {}).get(key)
            if a != b:
                warnings.append(f"{test.label}: {section}.{key} = {b!r}, {control.label} has {a!r}")
        if control.config["training"].get("seed") is None:
            warnings.append(f"{control.label}: no training.seed: the runs do not start from the same weights")
    if refusals:
        raise CompareError("refusing to compare runs with different global batches or tokens per step (their "
                           "curves differ whatever the parallelism does):\n  " + "\n  ".join(refusals))
    return warnings


@dataclasses.dataclass
class Verdict:
    label: str
    steps: list[int]
    rel: dict[int, float]  # step -> relative difference to the control
    missing: list[int]  # control steps the test lacks
    ok: bool

    @property
    def worst(self) -> tuple[int, float]:
        step = max(self.rel, key=lambda s: (self.rel[s], -s))
        return step, self.rel[step]


def relative(a: float, b: float) -> float:
    """|a - b| / |b|, with non-finite values (a diverged run) counted as infinitely far."""
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / abs(b) if b else (0.0 if a == b else math.inf)


def judge(control: RunData, tests: list[RunData], tolerance: float) -> list[Verdict]:
    verdicts = []
    for test in tests:
        steps = sorted(set(control.losses) & set(test.losses))
        missing = sorted(set(control.losses) - set(test.losses))
        rel = {s: relative(test.losses[s], control.losses[s]) for s in steps}
        ok = bool(steps) and not missing and max(rel.values()) <= tolerance
        verdicts.append(Verdict(test.label, steps, rel, missing, ok))
    return verdicts


def rows_to_print(steps: list[int], verdicts: list[Verdict], every: int | None) -> list[int]:
    """Every ``every``-th step (about 25 rows by default), plus the first, the last and each test's worst."""
    if not steps:
        return []
    every = every or max(1, math.ceil(len(steps) / 25))
    keep = {s for i, s in enumerate(steps) if i % every == 0} | {steps[0], steps[-1]}
    keep |= {v.worst[0] for v in verdicts if v.rel}
    return sorted(keep)


def format_table(control: RunData, tests: list[RunData], verdicts: list[Verdict], every: int | None) -> str:
    steps = sorted(control.losses)
    head = f"{'step':>6} {control.label[:14]:>14}"
    for test in tests:
        head += f" {test.label[:14]:>14} {'rel diff':>9}"
    lines = [head]
    for step in rows_to_print(steps, verdicts, every):
        line = f"{step:>6} {control.losses[step]:>14.7f}"
        for test, verdict in zip(tests, verdicts):
            if step in test.losses:
                line += f" {test.losses[step]:>14.7f} {verdict.rel[step]:>9.2e}"
            else:
                line += f" {'-':>14} {'-':>9}"
        lines.append(line)
    return "\n".join(lines)


def format_summary(control: RunData, tests: list[RunData], verdicts: list[Verdict], tolerance: float) -> str:
    lines = [f"{'run':<20} {'steps':>5} {'step-1 rel':>10} {'max rel':>9} {'at step':>7} {'mean rel':>9} "
             f"{'final loss':>10}  result (tolerance {tolerance:g})"]
    last = max(control.losses)
    lines.append(f"{control.label[:20]:<20} {len(control.losses):>5} {'-':>10} {'-':>9} {'-':>7} {'-':>9} "
                 f"{control.losses[last]:>10.5f}  control, global batch {control.global_batch} x seq "
                 f"{control.seq_len}")
    for test, v in zip(tests, verdicts):
        if not v.rel:
            lines.append(f"{test.label[:20]:<20} {0:>5}  no step in common with the control  FAIL")
            continue
        step, worst = v.worst
        first = v.rel.get(min(control.losses), math.nan)
        mean = sum(v.rel.values()) / len(v.rel)
        final = test.losses[max(test.losses)]
        note = "PASS" if v.ok else "FAIL"
        if v.missing:
            note += f" (stops before step {v.missing[0]}: {len(v.missing)} control step(s) missing)"
        lines.append(f"{test.label[:20]:<20} {len(v.steps):>5} {first:>10.2e} {worst:>9.2e} {step:>7} {mean:>9.2e} "
                     f"{final:>10.5f}  {note}")
    return "\n".join(lines)


def plot(control: RunData, tests: list[RunData], verdicts: list[Verdict], tolerance: float, path: Path,
         metric: str = "loss") -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on CI machines
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    steps = sorted(control.losses)
    top.plot(steps, [control.losses[s] for s in steps], color="black", linewidth=2.2, label=f"{control.label} "
             "(control)")
    floor = tolerance * 1e-4  # where exact zeros are drawn on the log axis
    for test, verdict in zip(tests, verdicts):
        ts = sorted(test.losses)
        (line,) = top.plot(ts, [test.losses[s] for s in ts], linewidth=1.1, linestyle="--", label=test.label)
        rel = [max(verdict.rel[s], floor) if math.isfinite(verdict.rel[s]) else float("nan") for s in verdict.steps]
        bottom.plot(verdict.steps, rel, color=line.get_color(), linewidth=1.0,
                    label=f"{test.label}: max {verdict.worst[1]:.1e}" if verdict.rel else test.label)
    top.set_ylabel(metric)
    top.set_title(f"{metric} vs control: global batch {control.global_batch} x seq {control.seq_len}")
    top.grid(alpha=0.3)
    top.legend()
    bottom.axhline(tolerance, color="red", linestyle=":", label=f"tolerance {tolerance:g}")
    bottom.set_yscale("log")
    bottom.set_ylim(bottom=floor / 2)
    bottom.set_ylabel("|test - control| / control")
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3, which="both")
    bottom.legend(fontsize="small")
    bottom.text(0.01, 0.03, f"bitwise-equal steps drawn at {floor:.0e}", transform=bottom.transAxes, fontsize=8,
                color="gray")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--control", help="config overrides of the control run, one quoted string")
    p.add_argument("--control-from", type=Path, metavar="DUMP",
                   help="reuse a finished control run (its dump folder) instead of training one again")
    p.add_argument("--test", action="append", default=[], help="config overrides of a test run (repeatable)")
    p.add_argument("--from-logs", nargs="+", type=Path, metavar="DUMP",
                   help="compare existing dump folders instead of running (the first is the control)")
    p.add_argument("--names", help="comma-separated labels, control first (default: control, test1, ... or the "
                                   "folder names)")
    p.add_argument("--steps", type=int, default=200, help="training steps per run (default: 200)")
    p.add_argument("--ngpu", help="ranks per run: one number, or one per run, control first (e.g. 1,8,8); "
                                  "default 8. With --from-logs, only needed for a run whose dp degree is unknown")
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="TOML config of every run")
    p.add_argument("--output-dir", type=Path,
                   help="where the runs' dump folders go (default: outputs/loss_compare/<time>)")
    p.add_argument("--tolerance", type=float, default=1e-4,
                   help="max relative difference at any step (default 1e-4, float32 on CPU; use about 1e-2 for "
                        "bf16 on GPUs, see docs/converging.md)")
    p.add_argument("--metric", default="loss", choices=METRICS,
                   help="the curve to compare: the training loss (default) or, for runs with validation.enable, "
                        "validation/loss or validation/perplexity (compared at the steps that validated)")
    p.add_argument("--plot", type=Path, help="write a PNG of the curves and their differences here")
    p.add_argument("--print-every", type=int, help="table row every N steps (default: about 25 rows)")
    args = p.parse_args(argv)
    if args.from_logs:
        if args.control or args.test or args.control_from:
            p.error("--from-logs reads finished runs; it does not take --control/--control-from/--test")
        if len(args.from_logs) < 2:
            p.error("--from-logs needs the control's dump folder and at least one test's")
    elif (args.control is None) == (args.control_from is None) or not args.test:
        p.error("give --control or --control-from, and at least one --test (or --from-logs DIR DIR ...)")
    n_runs = len(args.from_logs) if args.from_logs else 1 + len(args.test)
    if args.ngpu is None:
        # Runs default to 8 ranks; finished runs are read as they are.
        args.ranks = [None if args.from_logs else 8] * n_runs
    else:
        try:
            ranks = [int(x) for x in args.ngpu.split(",")]
        except ValueError:
            p.error(f"--ngpu {args.ngpu!r}: expected a number or comma-separated numbers")
        if len(ranks) == 1:
            ranks *= n_runs
        if len(ranks) != n_runs or min(ranks) < 1:
            p.error(f"--ngpu: {len(ranks)} value(s) for {n_runs} runs")
        args.ranks = ranks
    if args.names:
        args.labels = args.names.split(",")
        if len(args.labels) != n_runs:
            p.error(f"--names: {len(args.labels)} label(s) for {n_runs} runs")
    elif args.from_logs:
        args.labels = [d.resolve().name for d in args.from_logs]
    elif args.control_from:
        args.labels = [args.control_from.resolve().name, *(f"test{i + 1}" for i in range(len(args.test)))]
    else:
        args.labels = ["control", *(f"test{i + 1}" for i in range(len(args.test)))]
    if len(set(args.labels)) != len(args.labels):
        p.error(f"run labels must differ: {args.labels} (use --names)")
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if args.tolerance < 0:
        p.error("--tolerance must be >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot:
        try:
            import matplotlib  # noqa: F401  (checked before hours of training, not after)
        except ImportError:
            print("--plot needs matplotlib: pip install -e .[plot]  (or pip install matplotlib)", file=sys.stderr)
            return 2
    try:
        if args.from_logs:
            dumps = [d.resolve() for d in args.from_logs]
        else:
            out = (args.output_dir or REPO / "outputs" / "loss_compare" / time.strftime("%Y%m%d-%H%M%S")).resolve()
            dumps = [out / label for label in args.labels]
            jobs = list(zip(args.labels, [args.control, *args.test], args.ranks, dumps))
            if args.control_from:
                dumps[0] = args.control_from.resolve()
                jobs = jobs[1:]
            for label, overrides, ranks, dump in jobs:
                launch(label, shlex.split(overrides), ranks, args, dump)
        runs = [load_run(label, dump, w, args.metric) for label, dump, w in zip(args.labels, dumps, args.ranks)]
        control, tests = runs[0], runs[1:]
        warnings = check_comparable(control, tests, args.metric)
    except CompareError as e:
        print(f"loss_compare: {e}", file=sys.stderr)
        return 2
    for warning in warnings:
        print(f"warning: {warning}")
    verdicts = judge(control, tests, args.tolerance)
    print(format_table(control, tests, verdicts, args.print_every))
    print()
    print(format_summary(control, tests, verdicts, args.tolerance))
    if args.plot:
        plot(control, tests, verdicts, args.tolerance, args.plot, args.metric)
        print(f"plot: {args.plot}")
    return 0 if all(v.ok for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
