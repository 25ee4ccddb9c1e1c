"""scripts/install.sh: which torch it installs and which torch it pins, on any torch build.

The script runs for real against a stand-in interpreter: ``python3`` with a fake ``torch``
package and distribution record first on its path, whose ``-m pip`` records its arguments
and the constraints file instead of installing. So the test costs a second, needs no
network and no venv, and checks the pin the script would hand to pip.
(Installs into fresh venvs, with the CPU and the CUDA builds, are in docs/versions.md.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

# The stand-in interpreter: pip records what it was asked, anything else runs the real Python.
_SHIM = """#!/usr/bin/env bash
if [[ "$1" == -m && "$2" == pip ]]; then
  shift 2
  constraints=""
  args=("$@")
  for i in "${!args[@]}"; do
    [[ "${args[$i]}" == -c ]] && constraints=$(cat "${args[$((i + 1))]}")
  done
  "$REAL_PY" -c 'import json, sys; print(json.dumps({"args": sys.argv[2:], "constraints": sys.argv[1]}))' \\
    "$constraints" "$@" >>"$PIP_LOG"
  exit 0
fi
exec "$REAL_PY" "$@"
"""


def _fake_torch(root: Path, dist_version: str, module_version: str) -> Path:
    """A ``torch`` whose distribution record says ``dist_version`` and whose ``__version__`` says the other."""
    site = root / "site"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text(f"__version__ = {module_version!r}\n")
    info = site / f"torch-{dist_version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {dist_version}\n")
    return site


def _run_install(tmp_path: Path, dist_version: str, module_version: str) -> list[dict]:
    site = _fake_torch(tmp_path, dist_version, module_version)
    shim = tmp_path / "python"
    shim.write_text(_SHIM)
    shim.chmod(0o755)
    bin_dir = tmp_path / "bin"  # no GPU, whatever machine runs the test: the CPU default applies
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    log = tmp_path / "pip.log"
    env = {**os.environ, "PYTHON": str(shim), "REAL_PY": sys.executable, "PIP_LOG": str(log),
           "PYTHONPATH": str(site), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    env.pop("TORCH_SPEC", None)
    env.pop("EXTRAS", None)
    done = subprocess.run(["bash", str(REPO / "scripts" / "install.sh")], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return [json.loads(line) for line in log.read_text().splitlines()]


@pytest.mark.slow
def test_cuda_build_is_kept_and_pinned_by_its_distribution_version(tmp_path: Path):
    # PyPI's CUDA wheel: distribution 2.14.1, torch.__version__ 2.14.1+cu130. Pinning the latter
    # made pip fail with ResolutionImpossible.
    calls = _run_install(tmp_path, "2.14.1", "2.14.1+cu130")
    assert len(calls) == 1, f"install.sh must not reinstall a torch >= 2.11 that is there: {calls}"
    assert calls[0]["constraints"].strip() == "torch==2.14.1"
    assert calls[0]["args"][-2:] == ["-e", ".[dev]"]


@pytest.mark.slow
def test_cpu_build_pin_keeps_its_local_version(tmp_path: Path):
    calls = _run_install(tmp_path, "2.13.0+cpu", "2.13.0+cpu")
    assert [c["constraints"].strip() for c in calls] == ["torch==2.13.0+cpu"]


@pytest.mark.slow
def test_old_torch_gets_the_cpu_default_first(tmp_path: Path):
    calls = _run_install(tmp_path, "2.10.0", "2.10.0")
    assert calls[0]["args"] == ["install", "-q", "torch==2.13.0"], calls
    assert len(calls) == 2 and calls[1]["args"][-2:] == ["-e", ".[dev]"]
