"""The planner's command line (``scripts/plan.py``) and ``train.py --dry_run``.

    python scripts/plan.py --cluster NAME --world_size N [--json] [--search [--search_float8]] [--moe_imbalance F]
        [train.py overrides]
    python train.py --dry_run --world_size N [train.py overrides]

A config problem prints the preflight's lines (``config error: ...``) and exits 2, as a launch does.
``--help`` prints the planner's own options and exits 0. While it simulates, the planner says on
stderr what it simulates and how many of how many (``progress.py``); the report goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import sys

from torchtitan.config import ConfigError, ConfigManager
from torchtitan.planning.progress import Progress


def _parser(with_cluster: bool) -> argparse.ArgumentParser:
    # No argparse help option: the arguments it does not know are train.py's, and are passed on.
    p = argparse.ArgumentParser(
        prog="scripts/plan.py" if with_cluster else "train.py --dry_run", add_help=False,
        description="Plan a training job from one CPU: memory per rank, traffic"
                    + (", step time and MFU on a cluster, or the best layouts (--search)." if with_cluster else "."),
        epilog="Every other argument is train.py's (--job.config_file FILE, --section.key VALUE; "
               "`python train.py --help` lists them). See docs/planning.md.")
    p.add_argument("--world_size", type=int, required=True, help="ranks of the job to plan")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--pp_ranks", type=str, default=None,
                   help="comma-separated pipeline ranks to simulate (default: one per stage shape)")
    p.add_argument("--no_symmetry", action="store_true",
                   help="simulate every pipeline rank and every block instead of counting alike ones (slow; a check)")
    p.add_argument("--moe_imbalance", type=float, default=1.0,
                   help="models with experts: max over mean tokens per expert, >= 1 (default 1: balanced routing)")
    if with_cluster:
        p.add_argument("--cluster", required=True, help="a cluster name or a .toml file of one's own")
        p.add_argument("--search", action="store_true", help="rank the valid layouts for this world size")
        p.add_argument("--top", type=int, default=5, help="layouts shown by --search")
        p.add_argument("--search_float8", action="store_true",
                       help="--search also tries every layout in Float8 (clusters with an FP8 peak; needs torchao)")
    return p


def _config_errors(e: ConfigError) -> int:
    for problem in e.problems:
        print(f"config error: {problem}", file=sys.stderr)
    return 2


def dry_run_main(argv: list[str]) -> int:
    """``train.py --dry_run``: the dry run's memory and traffic, no cluster model."""
    progress = Progress()  # its clock starts before torch's import, which is part of the wait
    own, rest = _parser(False).parse_known_args(argv)
    from torchtitan.planning.dry_run import dry_run
    from torchtitan.planning.report import dry_run_text

    if (bad := _bad_imbalance(own)) is not None:
        return bad
    try:
        run = dry_run(ConfigManager().parse_args(rest), own.world_size, pp_ranks=_ranks(own.pp_ranks),
                      symmetry=not own.no_symmetry, moe_imbalance=own.moe_imbalance, progress=progress)
    except ConfigError as e:
        return _config_errors(e)
    if own.json:
        print(json.dumps({"world_size": run.world_size, "notes": run.notes,
                          "ranks": [r.to_json() for r in run.ranks]}))
    else:
        print(dry_run_text(run))
    return 0


def _bad_imbalance(own: argparse.Namespace) -> int | None:
    """Exit status 2 and the one line for an imbalance factor below 1; None when it is good."""
    from torchtitan.planning.moe import ImbalanceError, check_imbalance

    try:
        check_imbalance(own.moe_imbalance)
    except ImbalanceError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return None


def _ranks(text: str | None) -> list[int] | None:
    return None if text is None else [int(x) for x in text.split(",")]


def plan_main(argv: list[str]) -> int:
    """``scripts/plan.py``: dry run plus the step-time model of a cluster, or the layout search."""
    parser = _parser(True)
    if "--help" in argv or "-h" in argv:
        parser.print_help()
        return 0
    progress = Progress()  # its clock starts before torch's import, which is part of the wait
    own, rest = parser.parse_known_args(argv)
    from torchtitan.planning.clusters import ClusterError, load_cluster

    try:
        cluster = load_cluster(own.cluster)
    except ClusterError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if (bad := _bad_imbalance(own)) is not None:
        return bad
    try:
        cfg = ConfigManager().parse_args(rest)
        if own.search:
            return _search(rest, own, cluster, progress)
        from torchtitan.planning.cost import estimate
        from torchtitan.planning.dry_run import dry_run
        from torchtitan.planning.report import dry_run_text, estimate_text

        run = dry_run(cfg, own.world_size, pp_ranks=_ranks(own.pp_ranks), symmetry=not own.no_symmetry,
                      moe_imbalance=own.moe_imbalance, progress=progress)
    except ConfigError as e:
        return _config_errors(e)
    est = estimate(run, cluster)
    if own.json:
        print(json.dumps(est.to_json()))
    else:
        print(dry_run_text(run))
        print(estimate_text(est, cluster.name))
    return 0


def _search(args: list[str], own, cluster, progress: Progress) -> int:
    from torchtitan.planning.search import search

    results = search(args, own.world_size, cluster, moe_imbalance=own.moe_imbalance, float8=own.search_float8,
                     progress=progress)
    if own.json:
        print(json.dumps({"layouts": [r.to_json() for r in results]}))
        return 0
    from torchtitan.planning.search import search_text

    print(search_text(results[: own.top], cluster.name))
    return 0
