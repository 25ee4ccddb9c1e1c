"""TP/CP config checks in preflight: every problem named with its fix, before any process group exists."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchtitan.config import ConfigError, ConfigManager
from torchtitan.trainer import preflight

DEBUG = str(Path(__file__).resolve().parents[2] / "train_configs" / "debug_model.toml")


def _problems(world_size: int, *overrides: str) -> list[str]:
    cfg = ConfigManager().parse_args(["--job.config_file", DEBUG, *overrides])
    with pytest.raises(ConfigError) as info:
        preflight(cfg, world_size)
    return info.value.problems


def test_tp_degree_must_divide_heads_dim_and_vocab():
    # Debug model: 16 heads, 8 KV heads, dim 256, FFN 768, vocab 2048.
    problems = _problems(3, "--parallelism.tensor_parallel_degree=3", "--parallelism.data_parallel_shard_degree=1",
                         "--training.seq_len=63")
    text = "\n".join(problems)
    for what in ("n_heads (16)", "n_kv_heads (8)", "dim (256)", "vocab size 2048"):
        assert what in text, what
    assert "FFN hidden size" not in text  # 768 is divisible by 3
    assert all("tensor_parallel_degree=3" in p or "seq_len" in p for p in problems)


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["--parallelism.context_parallel_degree=2", "--training.seq_len=66"],
         "seq_len=66 must be divisible by 2 * context_parallel_degree (4, load-balanced chunks) = 4; change seq_len"),
        (["--parallelism.tensor_parallel_degree=2", "--training.seq_len=65"],
         "= 2; change seq_len or set --parallelism.enable_sequence_parallel=false"),
        (["--parallelism.tensor_parallel_degree=2", "--parallelism.context_parallel_degree=2", "--training.seq_len=68"],
         "(4, load-balanced chunks) x tensor_parallel_degree (2, sequence parallel) = 8"),
    ],
)
def test_sequence_length_must_split_evenly(overrides, needle):
    problems = _problems(4, "--parallelism.data_parallel_shard_degree=-1", *overrides)
    assert len(problems) == 1 and needle in problems[0], problems


def test_valid_tp_cp_layouts_pass():
    for overrides in (["--parallelism.tensor_parallel_degree=2"], ["--parallelism.context_parallel_degree=2"],
                      ["--parallelism.tensor_parallel_degree=2", "--parallelism.enable_sequence_parallel=false",
                       "--training.seq_len=66"]):
        cfg = ConfigManager().parse_args(["--job.config_file", DEBUG, "--parallelism.data_parallel_shard_degree=-1",
                                          *overrides])
        assert preflight(cfg, 8).dims.world_size == 8


def test_tp_with_compile_is_rejected_with_the_way_out():
    problems = _problems(2, "--parallelism.tensor_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1",
                         "--training.compile")
    assert len(problems) == 1 and "turn off compile for TP layouts" in problems[0]


def test_warmup_longer_than_the_run_is_a_config_error():
    problems = _problems(1, "--training.steps=3", "--lr_scheduler.warmup_steps=5")
    assert any("--lr_scheduler.warmup_steps=5" in p and "training.steps=3" in p for p in problems), problems
