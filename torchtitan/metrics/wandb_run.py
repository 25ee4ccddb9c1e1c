"""Weights & Biases: the scalars TensorBoard gets and the effective config, from one rank, one W&B run per job.

The W&B run id is kept in ``<dump_folder>/wandb_run_id``. A job that resumes from a
checkpoint (it starts past step 0) continues the run whose id is there; a job that
starts at step 0 begins a new run and writes its id. The run's files go under
``<dump_folder>/wandb``; with ``WANDB_MODE=offline`` they stay there, with no network,
until ``wandb sync`` uploads them. wandb is an optional dependency (the ``wandb`` extra):
preflight names it when ``metrics.enable_wandb`` is set and it is missing, before any
process group exists. Usage: docs/metrics.md.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torchtitan.config.job_config import Metrics

logger = logging.getLogger(__name__)

RUN_ID_FILE = "wandb_run_id"
INSTALL = "pip install -e '.[wandb]' (or EXTRAS=dev,wandb scripts/install.sh)"


def wandb_problems(enable_wandb: bool) -> list[str]:
    """Preflight: the one line for a job that asks for W&B where wandb is not installed."""
    if enable_wandb and importlib.util.find_spec("wandb") is None:
        return [f"--metrics.enable_wandb needs the wandb package, which is not installed: {INSTALL}"]
    return []


def wandb_run_from_config(m: Metrics, dump_folder: str, config: Mapping[str, Any]) -> WandbRun | None:
    """The job's W&B run (not started), or None when ``metrics.enable_wandb`` is off; ``config``: the effective
    config the run records (``JobConfig.to_dict``)."""
    if not m.enable_wandb:
        return None
    return WandbRun(dump_folder, m.wandb_project, m.wandb_entity, m.wandb_run_name, m.wandb_group, config)


class WandbRun:
    """One W&B run, opened by ``start`` on the logging rank, continued across checkpoint resumes."""

    def __init__(self, dump_folder: str, project: str, entity: str | None, run_name: str | None,
                 group: str | None, config: Mapping[str, Any]) -> None:
        self.dump_folder = Path(dump_folder)
        self.project, self.entity, self.group = project, entity, group
        self.run_name = run_name or self.dump_folder.resolve().name
        self.config = dict(config)
        self._run: Any = None  # wandb.sdk.wandb_run.Run once started

    @property
    def run_id(self) -> str | None:
        return None if self._run is None else self._run.id

    def start(self, start_step: int) -> None:
        """Open the run: the stored one when resuming (``start_step > 0``), else a new one."""
        import wandb

        id_file = self.dump_folder / RUN_ID_FILE
        resume = start_step > 0 and id_file.exists()
        run_id = id_file.read_text().strip() if resume else None  # None: W&B draws a new id
        self.dump_folder.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=self.project, entity=self.entity, name=self.run_name, group=self.group, id=run_id,
            # "allow": an offline run, unknown to the server until synced, still resumes.
            resume="allow" if resume else None, dir=str(self.dump_folder), config=self.config,
            # The trainer's own log lines already reach the console and the launcher's log files.
            settings=wandb.Settings(console="off", silent=True),
        )
        if not resume:
            tmp = id_file.with_suffix(".tmp")
            tmp.write_text(self._run.id + "\n")
            os.replace(tmp, id_file)  # whole or absent, even if the job dies here
        logger.info("W&B run %s %s at step %d (%s mode): %s", self._run.id, "continued" if resume else "started",
                    start_step, os.environ.get("WANDB_MODE", "online"), self._run.dir)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
