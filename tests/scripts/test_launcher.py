"""run_llama_train.sh honours ``PYTHON``: the GPU count, the preflight and torchrun all run on it, and torchrun
gets ``PYTHONFAULTHANDLER=1``.

A stand-in interpreter logs each call and hands it to the real Python; asked for the GPU
count, it answers 1, so the launcher trains one rank for one step.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import CI_CONFIG, REPO

_SHIM = """#!/usr/bin/env bash
echo "$*" >>"$CALLS"
echo "faulthandler=${PYTHONFAULTHANDLER:-}" >>"$CALLS.env"
if [[ "$1" == -c && "$2" == *device_count* ]]; then
  echo 1
  exit 0
fi
exec "$REAL_PY" "$@"
"""


@pytest.mark.slow
def test_launcher_runs_everything_on_the_python_it_is_given(tmp_path):
    shim = tmp_path / "python"
    shim.write_text(_SHIM)
    shim.chmod(0o755)
    calls = tmp_path / "calls.log"
    env = {**os.environ, "PYTHON": str(shim), "REAL_PY": sys.executable, "CALLS": str(calls),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), "CONFIG_FILE": CI_CONFIG}
    env.pop("NGPU", None)
    env.pop("PYTHONFAULTHANDLER", None)  # the launcher's own default is under test
    out = subprocess.run(["bash", str(REPO / "run_llama_train.sh"), "--training.steps=1",
                          "--lr_scheduler.warmup_steps=0", f"--job.dump_folder={tmp_path / 'dump'}",
                          "--metrics.enable_tensorboard=false"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Training done: 1 steps" in out.stdout + out.stderr
    lines = calls.read_text().splitlines()
    assert len(lines) == 3, lines
    assert "device_count" in lines[0]
    assert lines[1].startswith(f"{REPO / 'train.py'} --preflight_only")
    assert lines[2].startswith("-m torch.distributed.run --standalone --nproc_per_node=1")
    # torchrun, and so its ranks, get Python's fault handler: a native crash prints the rank's Python stacks
    assert (tmp_path / "calls.log.env").read_text().splitlines()[2] == "faulthandler=1"
