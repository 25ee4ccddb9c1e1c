"""``--model.converters float8`` through run_llama_train.sh: a run that trains, and bad inputs that stop first.

Each bad input must end the launch in the launcher's own preflight (exit 2, its ``config error:`` line,
no rank started). A missing torchao and an untested release are staged by a folder put first on
PYTHONPATH: a ``torchao`` package that fails to import, or one whose metadata says 0.12.0.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DEBUG_CONFIG, REPO

pytestmark = pytest.mark.slow  # every test here starts the launcher

FP8 = "--model.converters=float8"


def _launch(tmp_path: Path, *overrides: str, nproc: int = 2, shadow: Path | None = None,
            timeout: float = 600) -> subprocess.CompletedProcess:
    path = [str(shadow)] if shadow is not None else []
    env = {**os.environ, "NGPU": str(nproc), "CONFIG_FILE": DEBUG_CONFIG, "PYTHON": sys.executable,
           "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([*path, str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(["bash", str(REPO / "run_llama_train.sh"), f"--job.dump_folder={tmp_path / 'dump'}",
                           "--metrics.enable_tensorboard=false", "--job.print_args=false", *overrides],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


def test_launcher_trains_float8_with_the_fp8_all_gather(tmp_path):
    out = _launch(tmp_path, FP8, "--training.steps=3", "--float8.enable_fsdp_float8_all_gather",
                  "--float8.precompute_float8_dynamic_scale_for_fsdp")
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "Float8 (tensorwise, FP8 all-gather): 42 of 43 linear layers converted; high precision: 1 filtered " \
           "(output)" in log
    assert "Float8: the all-gathered weights' scales are computed after each optimizer step" in log
    assert "Applied FSDP on mesh {'fsdp': 2}" in log and "Training done: 3 steps" in log


def _config_errors(out: subprocess.CompletedProcess) -> list[str]:
    assert out.returncode == 2, (out.returncode, (out.stdout + out.stderr)[-3000:])
    assert "[rank" not in out.stdout + out.stderr  # no rank started: the launcher's preflight stopped it
    return [line for line in out.stderr.splitlines() if line.startswith("config error")]


def _shadow(root: Path, init: str, version: str | None = None) -> Path:
    package = root / "torchao"
    (package / "float8").mkdir(parents=True)
    (package / "__init__.py").write_text(init)
    (package / "float8" / "__init__.py").write_text("")
    if version is not None:
        info = root / f"torchao-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torchao\nVersion: {version}\n")
    return root


@pytest.mark.parametrize(("case", "overrides", "expected"), [
    ("missing torchao", [FP8], "--model.converters=float8 needs torchao, which does not import"),
    ("untested torchao", [FP8], "--model.converters=float8: torchao 0.12.0 is not a tested version (tested: 0.18.x)"),
    ("unknown recipe", [FP8, "--float8.recipe_name=blockwise"], "--float8.recipe_name"),
    ("rowwise all-gather", [FP8, "--float8.recipe_name=rowwise", "--float8.enable_fsdp_float8_all_gather"],
     "--float8.enable_fsdp_float8_all_gather with --float8.recipe_name=rowwise: the FP8 all-gather needs one scale "
     "per tensor"),
])
def test_bad_float8_inputs_stop_in_the_launcher_with_one_line(tmp_path, case, overrides, expected):
    shadow = None
    if case == "missing torchao":
        shadow = _shadow(tmp_path / "shadow", "raise ImportError('no torchao in this environment')")
    elif case == "untested torchao":
        shadow = _shadow(tmp_path / "shadow", "", version="0.12.0")
    errors = _config_errors(_launch(tmp_path, *overrides, shadow=shadow, timeout=300))
    assert len(errors) == 1 and expected in errors[0], errors
