"""Weights & Biases through train.py and torchrun, offline: the scalars, the config, a resume, a missing wandb.

Two launches of 2 ranks share one dump folder: steps 1-2 (saving a checkpoint at step 2),
then a restart to step 4 that resumes from it. The offline run files are read back with
wandb's own reader (``wandb leet inspect --json``) and compared with the TensorBoard events
of the same launches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import tomllib
from conftest import DEBUG_CONFIG, REPO, run_torchrun

wandb = pytest.importorskip("wandb", reason="the wandb extra is not installed (pip install -e '.[wandb]')")

DEBUG = DEBUG_CONFIG


def _train(dump: Path, steps: int) -> subprocess.CompletedProcess:
    return run_torchrun(
        REPO / "train.py", "--job.config_file", DEBUG, f"--job.dump_folder={dump}", f"--training.steps={steps}",
        "--job.print_args=false", "--metrics.log_freq=1", "--metrics.enable_tensorboard", "--metrics.enable_wandb",
        "--metrics.wandb_project=titan-test", "--metrics.wandb_group=g1",
        "--checkpoint.enable_checkpoint", "--checkpoint.interval=2",
        env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})


def _read_offline_run(run_dir: Path) -> dict[str, Any]:
    """The run record and the history rows of one offline run, as wandb's own reader prints them."""
    (log,) = run_dir.glob("run-*.wandb")
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    history = {int(r["history"]["item"]["_step"]): r["history"]["item"] for r in records if r["type"] == "history"}
    return {"run": run, "history": history}


def _tensorboard(log_dir: Path) -> dict[int, dict[str, float]]:
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    scalars: dict[int, dict[str, float]] = {}
    multiplexer = EventMultiplexer()
    multiplexer.AddRunsFromDirectory(str(log_dir))
    multiplexer.Reload()
    for run, tags in multiplexer.Runs().items():
        for tag in tags["scalars"]:
            for event in multiplexer.Scalars(run, tag):
                scalars.setdefault(event.step, {})[tag] = event.value
    return scalars


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> dict[str, Any]:
    dump = tmp_path_factory.mktemp("wandb") / "job"
    configs = []  # each launch's effective config, as train.py wrote it in config.toml
    for steps in (2, 4):
        done = _train(dump, steps)
        assert done.returncode == 0, done.stderr[-4000:]
        configs.append(tomllib.loads((dump / "config.toml").read_text()))
    runs = sorted((dump / "wandb").glob("offline-run-*"))
    return {"dump": dump, "runs": [_read_offline_run(r) for r in runs], "tb": _tensorboard(dump / "tb"),
            "configs": configs}


def _assert_same_scalars(history: dict[int, dict[str, Any]], tb: dict[int, dict[str, float]], steps: list[int]):
    assert sorted(history) == steps
    for step in steps:
        logged = {k: v for k, v in history[step].items() if not k.startswith("_")}
        assert set(logged) == set(tb[step]), f"step {step}: W&B {sorted(logged)} vs TensorBoard {sorted(tb[step])}"
        for name, value in tb[step].items():  # TensorBoard keeps float32
            assert logged[name] == pytest.approx(value, rel=1e-6, abs=1e-12), (step, name)


def _assert_config(logged: dict[str, Any], effective: dict[str, Any]) -> None:
    """The W&B config holds every value of config.toml (which leaves unset values out; W&B has them as None)."""
    assert set(effective) <= set(logged)
    for section, values in effective.items():
        for key, value in values.items():
            assert logged[section][key] == value, f"{section}.{key}"


@pytest.mark.slow
def test_offline_run_has_tensorboards_scalars_and_the_config(launches):
    first = launches["runs"][0]
    assert len(launches["runs"]) == 2, "one W&B run per launch, from rank 0 only"
    _assert_same_scalars(first["history"], launches["tb"], [1, 2])
    assert {"loss", "grad_norm", "lr"} <= set(first["history"][1])
    run = first["run"]
    assert (run["project"], run["run_group"], run["display_name"]) == ("titan-test", "g1", "job")
    config = run["config"]["update"]
    _assert_config(config, launches["configs"][0])
    assert config["training"]["steps"] == 2 and config["metrics"]["enable_wandb"] is True


@pytest.mark.slow
def test_resumed_job_continues_the_same_run(launches):
    first, resumed = launches["runs"]
    run_id = (launches["dump"] / "wandb_run_id").read_text().strip()
    assert first["run"]["run_id"] == run_id and resumed["run"]["run_id"] == run_id
    assert resumed["run"].get("resume") is True and not first["run"].get("resume")
    _assert_same_scalars(resumed["history"], launches["tb"], [3, 4])  # from the checkpoint at step 2 on
    _assert_config(resumed["run"]["config"]["update"], launches["configs"][1])
    assert resumed["run"]["config"]["update"]["training"]["steps"] == 4


@pytest.mark.slow
def test_missing_wandb_is_one_line_before_any_process_group(tmp_path):
    # This interpreter's packages without wandb: python -S skips site-packages, PYTHONPATH gives the rest back.
    site_dir = Path(wandb.__file__).parents[1]
    visible = tmp_path / "site"
    visible.mkdir()
    for entry in site_dir.iterdir():
        if not entry.name.startswith("wandb"):
            (visible / entry.name).symlink_to(entry)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(visible)])
    done = subprocess.run([sys.executable, "-S", str(REPO / "train.py"), "--job.config_file", DEBUG,
                           f"--job.dump_folder={tmp_path / 'job'}", "--metrics.enable_wandb"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if "wandb" in line]
    assert lines == ["config error: --metrics.enable_wandb needs the wandb package, which is not installed: "
                     "pip install -e '.[wandb]' (or EXTRAS=dev,wandb scripts/install.sh)"], done.stderr[-3000:]
    assert "Traceback" not in done.stderr and not (tmp_path / "job").exists()
