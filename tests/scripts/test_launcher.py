"""run_llama_train.sh: what it runs, which config it trains, and what becomes of its ranks when it is killed.

- It honours ``PYTHON``: the GPU count, the preflight and torchrun all run on it, and torchrun gets
  ``PYTHONFAULTHANDLER=1``. A stand-in interpreter logs each call and hands it to the real Python;
  asked for the GPU count, it answers 1, so the launcher trains one rank for one step.
- It trains the config that ``--job.config_file`` names among its arguments (that launch trains the
  DeepSeek-V3 debug model that way), and refuses two different files (CONFIG_FILE and the argument)
  before torchrun starts.
- Its ranks, which torchrun starts in sessions of their own, stop without committing a checkpoint
  once the launcher's process group is SIGKILLed (``torchtitan/agent_watch.py``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import CI_CONFIG, REPO, torchrun_env

from torchtitan.checkpoint import store

_SHIM = """#!/usr/bin/env bash
echo "$*" >>"$CALLS"
echo "faulthandler=${PYTHONFAULTHANDLER:-}" >>"$CALLS.env"
if [[ "$1" == -c && "$2" == *device_count* ]]; then
  echo 1
  exit 0
fi
exec "$REAL_PY" "$@"
"""


DEEPSEEK_DEBUG = str(REPO / "train_configs" / "deepseek_v3_debug.toml")
LAUNCHER = str(REPO / "run_llama_train.sh")


def _launch_env(**extra: str) -> dict[str, str]:
    """A launch's environment without the launcher's own variables (so that their defaults apply), then ``extra``."""
    env = torchrun_env()
    for var in ("NGPU", "CONFIG_FILE", "PYTHONFAULTHANDLER"):
        env.pop(var, None)
    return {**env, **extra}


@pytest.mark.slow
def test_launcher_runs_the_given_python_and_the_config_file_argument(tmp_path):
    shim = tmp_path / "python"
    shim.write_text(_SHIM)
    shim.chmod(0o755)
    calls = tmp_path / "calls.log"
    # No CONFIG_FILE: the config comes from the arguments, and the launcher's default must not be read instead.
    # No NGPU and no PYTHONFAULTHANDLER: the launcher's own defaults are under test.
    env = _launch_env(PYTHON=str(shim), REAL_PY=sys.executable, CALLS=str(calls))
    out = subprocess.run(["bash", LAUNCHER, "--job.config_file", DEEPSEEK_DEBUG, "--training.steps=1",
                          "--lr_scheduler.warmup_steps=0", f"--job.dump_folder={tmp_path / 'dump'}",
                          "--metrics.enable_tensorboard=false", "--job.print_args=false"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Training done: 1 steps" in out.stdout + out.stderr
    # The model trained is the file's, not the debug Llama 3 the launcher defaults to
    assert "Model deepseek_v3 debugmodel:" in out.stdout + out.stderr, (out.stdout + out.stderr)[-3000:]
    lines = calls.read_text().splitlines()
    assert len(lines) == 3, lines
    assert "device_count" in lines[0]
    assert lines[1].startswith(f"{REPO / 'train.py'} --preflight_only")
    assert lines[2].startswith("-m torch.distributed.run --standalone --nproc_per_node=1")
    assert [line.count("--job.config_file") for line in lines[1:]] == [1, 1], lines
    # torchrun, and so its ranks, get Python's fault handler: a native crash prints the rank's Python stacks
    assert (tmp_path / "calls.log.env").read_text().splitlines()[2] == "faulthandler=1"


@pytest.mark.slow  # the launcher's preflight stops it: no torch import, about a second
def test_launcher_refuses_two_config_files_before_torchrun(tmp_path):
    env = _launch_env(NGPU="2", CONFIG_FILE=CI_CONFIG)
    out = subprocess.run(["bash", LAUNCHER, "--job.config_file", str(tmp_path / "missing.toml")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    (line,) = out.stderr.splitlines()  # one line, and nothing from torchrun
    assert line.startswith("config error: --job.config_file is given 2 times, naming 2 different files")
    assert CI_CONFIG in line and "missing.toml" in line and "CONFIG_FILE" in line


def _rank_pids(dump: Path) -> list[int]:
    """The ranks training into ``dump``: train.py processes that are not torchrun itself."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        text = b" ".join(argv).decode(errors="replace")
        if proc.name.isdigit() and str(dump) in text and "train.py" in text and "torch.distributed.run" not in text:
            pids.append(int(proc.name))
    return pids


def _alive(pid: int) -> bool:
    """Running, not exited (a zombie waiting for its reaper counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _committed(folder: Path) -> list[int]:
    return sorted(store.scan(folder).committed)


@pytest.mark.slow
def test_ranks_stop_without_committing_when_the_launcher_is_killed(tmp_path):
    """SIGKILL to the launcher's process group reaches torchrun's agent only; its two ranks must stop within a few
    seconds, with a line saying why, and commit no checkpoint after the kill."""
    dump, log = tmp_path / "dump", tmp_path / "launch.log"
    env = _launch_env(NGPU="2", CONFIG_FILE=CI_CONFIG, LOG_RANK="0,1", LAUNCH_PREFLIGHT="0")
    # Long enough to be training when killed; a checkpoint every step, so any rank still running commits one.
    with open(log, "w") as out:
        launcher = subprocess.Popen(["bash", LAUNCHER, "--training.steps=10000", f"--job.dump_folder={dump}",
                                     "--checkpoint.enable_checkpoint", "--checkpoint.interval=1",
                                     "--checkpoint.keep_latest_k=0", "--metrics.enable_tensorboard=false",
                                     "--metrics.log_freq=1000"],
                                    cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while not _committed(dump / "checkpoint") and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert launcher.poll() is None and _committed(dump / "checkpoint"), log.read_text()[-3000:]
        ranks = _rank_pids(dump)
        assert len(ranks) == 2, ranks
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()  # torchrun's agent is gone: its ranks now belong to init or a subreaper
        at_kill = _committed(dump / "checkpoint")
        stop_deadline = time.monotonic() + 5
        while any(map(_alive, ranks)) and time.monotonic() < stop_deadline:
            time.sleep(0.05)
        alive = [pid for pid in ranks if _alive(pid)]
        assert not alive, f"ranks {alive} still run 5 s after their launcher was killed\n{log.read_text()[-3000:]}"
        assert _committed(dump / "checkpoint") == at_kill, log.read_text()[-3000:]
        stopped = [line for line in log.read_text().splitlines() if "torchrun's agent (pid" in line]
        assert len(stopped) == 2 and all("without saving a checkpoint" in line for line in stopped), stopped
    finally:
        for pid in ranks:  # by pid: only what this test started
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
