"""Smoke runs of the scripts under ``benchmarks/`` and ``scripts/``, so that none rots unnoticed.

Each folder's smoke test (``tests/benchmarks/test_benchmark_smoke.py``, ``tests/scripts/test_script_smoke.py``)
lists every script of its folder with how the suite covers it (a ``Smoke``), and ``coverage_problems`` keeps
the list complete: a new script fails the test until it has an entry. A script is covered by any of:

- ``runs``: its ``main`` at a tiny shape; the run's output must hold its ``expect`` text. The benchmarks'
  runs share one Python process, started once (``run_all``: this file is that process's entry), so that
  they pay for one torch import between them and leave no torch state (threads, generators, process
  groups) in the pytest process.
- ``help``: ``--help`` prints its usage. For a script that needs a GPU, the peer (TorchTitan from PyPI) or
  a cluster, or whose smallest run starts several ranks (seconds of CPU each): ``why`` says which.
  Checked in the pytest process (an import and the argument parser; nothing runs).
- ``imports``: a module the scripts import (``common.py``) or load in another process: it imports.
- ``bash``: a shell script parses (``bash -n``), and every file of the repository it names exists.
- ``elsewhere``: a test file that runs it already; it must name the script.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import os
import re
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT_SUFFIXES = (".py", ".sh", ".slurm")
# Where the scripts import their siblings from when run as scripts (``python benchmarks/x.py`` puts its folder first).
SCRIPT_FOLDERS = (REPO / "benchmarks", REPO / "benchmarks" / "peer", REPO / "scripts")


@dataclass(frozen=True)
class Run:
    """One run of a script's ``main``: its arguments (``{tmp}``: a fresh folder, holding ``files``, name and
    text, first) and a text its output holds."""

    argv: tuple[str, ...]
    expect: str
    files: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Smoke:
    runs: tuple[Run, ...] = ()
    help: bool = False
    imports: bool = False
    bash: bool = False
    elsewhere: str = ""  # a test file, from the repository root
    why: str = ""  # why no more than ``help``/``bash`` runs here

    def covers(self) -> bool:
        return bool(self.runs or self.help or self.imports or self.bash or self.elsewhere)


def scripts_under(folder: str) -> list[str]:
    """Every script under ``folder`` (``benchmarks``, ``scripts``), as paths from the repository root."""
    return sorted(p.relative_to(REPO).as_posix() for p in (REPO / folder).rglob("*")
                  if p.suffix in SCRIPT_SUFFIXES and "__pycache__" not in p.parts)


def coverage_problems(folder: str, table: dict[str, Smoke]) -> list[str]:
    """What keeps ``table`` from covering every script of ``folder``, one line each."""
    scripts = scripts_under(folder)
    problems = [f"{path} has no smoke entry: add one to the table (a tiny run, --help, bash, or the test that "
                f"runs it)" for path in scripts if path not in table]
    problems += [f"the smoke table names {path}, which does not exist" for path in table if path not in scripts]
    for path, smoke in table.items():
        if not smoke.covers():
            problems.append(f"{path}: its smoke entry covers nothing")
        if smoke.elsewhere:
            test = REPO / smoke.elsewhere
            if not test.is_file():
                problems.append(f"{path}: {smoke.elsewhere} does not exist")
            elif not _names(test.read_text(), Path(path)):
                problems.append(f"{path}: {smoke.elsewhere} does not name it, so it cannot be the test that runs it")
    return problems


def _names(text: str, script: Path) -> bool:
    """Whether a test's ``text`` names ``script``: its file name, or an import of it."""
    return script.name in text or re.search(rf"^\s*(?:import|from) {script.stem}\b", text, re.MULTILINE) is not None


def load(path: str):
    """The script at ``path`` (from the repository root) as a module, its sibling folders importable."""
    for folder in SCRIPT_FOLDERS:
        if str(folder) not in sys.path:
            sys.path.append(str(folder))
    from conftest import load_script

    return load_script(path)


def call_main(module, argv: list[str]) -> int:
    """``module.main`` on ``argv`` (through ``sys.argv`` when it takes none): its exit status."""
    main = module.main
    takes_argv = bool(inspect.signature(main).parameters)
    saved = sys.argv
    sys.argv = [module.__file__, *argv]
    try:
        result = main(argv) if takes_argv else main()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved
    return result if isinstance(result, int) else 0


def named_paths(shell_script: str) -> list[str]:
    """Files of the repository a shell script names (``benchmarks/x.py``, ``tests/y/test_z.py``, a config)."""
    text = (REPO / shell_script).read_text()
    found = re.findall(r"(?<![\w/.$-])((?:benchmarks|scripts|tests|train_configs|torchtitan)/[\w/.-]+\.(?:py|sh|toml))",
                       text)
    return sorted(set(found))


def run_all(runs: list[tuple[str, Run]], tmp: Path, timeout: float = 600) -> dict[str, dict]:
    """Every ``(script, run)`` in one new Python process (this file), in order: ``{key: {"status", "output",
    "seconds"}}`` with ``key`` from ``run_key``."""
    payload = json.dumps([[path, list(run.argv), dict(run.files)] for path, run in runs])
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, __file__, str(tmp)], input=payload, capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("SMOKE ")]
    results = dict(json.loads(line[len("SMOKE "):]) for line in lines)
    if len(results) != len(runs):
        raise RuntimeError(f"the smoke process ended after {len(results)} of {len(runs)} runs (exit "
                           f"{proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return results


def run_key(path: str, run: Run) -> str:
    return " ".join([path, *run.argv])


def _run_one(path: str, argv: list[str], files: dict[str, str], tmp: Path) -> dict:
    """In the smoke process: one run, its output captured (a failure's traceback is its output)."""
    folder = tmp / re.sub(r"\W+", "_", run_key(path, Run(tuple(argv), "")))[:100]
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    argv = [a.replace("{tmp}", str(folder)) for a in argv]
    out = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            status = call_main(load(path), argv)
        except BaseException:  # noqa: BLE001 - the test reports it with the script's name
            status, _ = 1, out.write(traceback.format_exc())
    return {"status": status, "output": out.getvalue()[-6000:], "seconds": round(time.perf_counter() - start, 2)}


if __name__ == "__main__":
    work = Path(sys.argv[1])
    for script, arguments, inputs in json.loads(sys.stdin.read()):
        result = _run_one(script, arguments, inputs, work)
        print("SMOKE " + json.dumps([run_key(script, Run(tuple(arguments), "")), result]), flush=True)
