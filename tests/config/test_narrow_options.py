"""Packages take the config sections they read (or a small options dataclass built by their caller), not the
whole ``JobConfig`` (issue 61, part 5): what a function depends on shows in its signature."""

from __future__ import annotations

import ast

from conftest import REPO

PACKAGE = REPO / "torchtitan"
# Done: no function here takes a parameter annotated JobConfig. Add a package or module once it is narrowed.
NARROWED = ("quantization", "fault_tolerance", "downstream", "metrics", "datasets", "stability", "evaluate.py",
            "checkpoint/selection.py", "checkpoint/manager.py", "checkpoint/loader.py", "train_step/select.py",
            "planning/search.py", "planning/repeats.py", "planning/pipeline.py", "distributed/pipeline_plan.py")
# The dry run builds the trainer's own parts, so the whole job reaches it, but only at its entries: the public
# dry_run(s), the preflight (plan_job) and the build of one simulated rank (simulate_rank).
WHOLE_JOB_ENTRIES = {"planning/dry_run.py": {"dry_run(cfg)", "dry_runs(jobs)", "plan_job(cfg)", "simulate_rank(cfg)"}}


def _job_config_parameters(path, lines: bool = True) -> list[str]:
    """``path:line function(parameter)`` for each parameter whose annotation names JobConfig (without ``lines``:
    ``function(parameter)``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            every = [*args.posonlyargs, *args.args, *args.kwonlyargs, *filter(None, (args.vararg, args.kwarg))]
            where = f"{path.relative_to(REPO)}:{node.lineno} " if lines else ""
            found += [f"{where}{node.name}({a.arg})" for a in every
                      if a.annotation is not None and "JobConfig" in ast.unparse(a.annotation)]
    return found


def test_the_narrowed_packages_take_sections_not_the_whole_job_config():
    files = [f for name in NARROWED for f in
             ((PACKAGE / name).rglob("*.py") if (PACKAGE / name).is_dir() else [PACKAGE / name])]
    assert len(files) > len(NARROWED)  # the names resolve to modules
    found = [line for path in sorted(files) for line in _job_config_parameters(path)]
    assert found == [], "take the sections read (torchtitan/config/job_config.py), not JobConfig:\n" + "\n".join(found)


def test_the_dry_run_takes_the_whole_job_config_only_at_its_entries():
    for name, entries in WHOLE_JOB_ENTRIES.items():
        found = _job_config_parameters(PACKAGE / name, lines=False)
        assert set(found) == entries, (f"{name}: {', '.join(sorted(set(found) - entries))} below its entries: take "
                                       "the sections read (torchtitan/config/job_config.py), not JobConfig")
