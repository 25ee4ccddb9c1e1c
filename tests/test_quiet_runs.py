"""A default run of every shipped debug config prints no warning (issue 60: a warning names something the project
should fix, or it is noise that hides the ones that do).

One 2-rank world trains each config for two steps in turn, as train.py would (its logger, its Trainer), each rank's
output to a file; the models without a debug config of their own (dense Qwen3, Mixtral) take the Qwen3-MoE one's.
Only the sequences are shorter than the configs' (16 tokens), and one world serves all of them: a world's start costs
more than a run.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import REPO
from dist_harness import run_ranks

pytestmark = pytest.mark.slow  # starts a gloo world

CONFIGS = REPO / "train_configs"
RUNS = {
    "llama3": [f"--job.config_file={CONFIGS / 'debug_model.toml'}"],
    "llama3_float8": [f"--job.config_file={CONFIGS / 'debug_model.toml'}", "--model.converters=float8"],
    "qwen3": [f"--job.config_file={CONFIGS / 'qwen3_debug_moe.toml'}", "--model.flavor=debugmodel"],
    "qwen3_moe": [f"--job.config_file={CONFIGS / 'qwen3_debug_moe.toml'}"],
    "mixtral": [f"--job.config_file={CONFIGS / 'qwen3_debug_moe.toml'}", "--model.name=mixtral",
                "--model.flavor=debugmodel"],
    "deepseek_v3": [f"--job.config_file={CONFIGS / 'deepseek_v3_debug.toml'}"],
    "gpt_oss": [f"--job.config_file={CONFIGS / 'gpt_oss_debug.toml'}"],
}
# A warning line: Python's ("UserWarning: ..."), torch's logger ones ("W1128 19:23:52.623000 ... _pytree.py:630] ...",
# "[rank0]:W1128 ..."), torchao's and the project's through the logger ("... WARNING ..."): any "warning", any case.
WARNING_LINE = re.compile(r"^.*(?:warning|^(?:\[rank\d+\]:)?W\d{4} ).*$", re.MULTILINE | re.IGNORECASE)


def _train_each_config(rank: int, world_size: int, dump: str) -> list[str]:
    from torchtitan.config import ConfigManager
    from torchtitan.logging_setup import init_logger
    from torchtitan.trainer import Trainer

    init_logger(rank)
    done = []
    for name, overrides in RUNS.items():
        cfg = ConfigManager().parse_args([*overrides, f"--job.dump_folder={dump}/{name}", "--training.steps=2",
                                          "--training.seq_len=16"])
        Trainer(cfg).train()  # closes its checkpointer and metrics, as in train.py
        done.append(name)
    return done


def test_default_runs_of_the_shipped_debug_configs_print_no_warning(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    done = run_ranks(_train_each_config, 2, str(tmp_path), log_dir=str(logs), timeout=300)
    assert done == [list(RUNS)] * 2
    for rank in range(2):
        output = (logs / f"rank{rank}.log").read_text(errors="replace")
        assert output.count("Training done") == len(RUNS), output[-3000:]
        warnings = WARNING_LINE.findall(output)
        assert not warnings, f"rank {rank} printed {len(warnings)} warning line(s):\n" + "\n".join(warnings[:10])
