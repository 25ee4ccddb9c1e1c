"""Config parsing: precedence, every error the issue names, and --help."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from torchtitan.config import ConfigError, ConfigManager, to_toml
from torchtitan.config.manager import tomllib
from torchtitan.models.registry import config_help


def parse(*argv: str):
    return ConfigManager().parse_args(list(argv))


def problems(*argv: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse(*argv)
    return info.value.problems


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def test_defaults_without_file():
    cfg = parse()
    assert cfg.parallelism.data_parallel_shard_degree == -1
    assert cfg.training.seed is None
    assert cfg.training.seed_sharded_dims == ["pp", "dp_shard", "cp", "ep", "tp"]


def test_precedence_cli_over_toml_over_default(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 7\nbatch_size = 3\n[optimizer]\nlr = 0.5\n")
    cfg = parse("--job.config_file", path, "--training.steps=20")
    assert cfg.training.steps == 20  # CLI beats TOML
    assert cfg.training.batch_size == 3  # TOML beats default
    assert cfg.optimizer.lr == 0.5
    assert cfg.training.seq_len == 2048  # default kept


def test_both_cli_spellings_booleans_and_lists():
    cfg = parse(
        "--training.steps", "5", "--training.seq_len=32", "--training.compile",
        "--job.print_args=false", "--training.seed_sharded_dims", "tp,pp", "--optimizer.betas=0.8,0.9",
        "--training.deterministic", "true",
    )
    assert (cfg.training.steps, cfg.training.seq_len) == (5, 32)
    assert cfg.training.compile is True and cfg.job.print_args is False and cfg.training.deterministic is True
    assert cfg.training.seed_sharded_dims == ["tp", "pp"]
    assert cfg.optimizer.betas == [0.8, 0.9]
    assert parse("--training.seed_sharded_dims=").training.seed_sharded_dims == []
    assert parse("--training.seed=5", "--training.seed=none").training.seed is None


def test_unknown_cli_key_suggests_closest():
    (msg,) = problems("--training.stpes=3")
    assert "unknown option --training.stpes" in msg and "training.steps" in msg


def test_unknown_toml_section_and_key(tmp_path):
    path = write(tmp_path, "[trainig]\nsteps = 3\n[optimizer]\nlearning_rate = 1.0\n")
    msgs = problems("--job.config_file", path)
    assert any("unknown section [trainig]" in m and "'training'" in m for m in msgs)
    assert any("unknown key 'learning_rate' in [optimizer]" in m for m in msgs)
    assert all(path in m for m in msgs)


def test_wrong_types_toml_and_cli(tmp_path):
    path = write(tmp_path, '[training]\nsteps = "ten"\ncompile = 1\n')
    msgs = problems("--job.config_file", path, "--training.batch_size=big")
    assert any("[training] steps" in m and "expected int" in m for m in msgs)
    assert any("[training] compile" in m for m in msgs)
    assert any("--training.batch_size: 'big' is not an integer" in m for m in msgs)


def test_malformed_toml_names_line(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 3\nseq_len = = 4\n")
    (msg,) = problems("--job.config_file", path)
    assert "malformed TOML" in msg and "line 3" in msg


def test_missing_config_file(tmp_path):
    (msg,) = problems("--job.config_file", str(tmp_path / "nope.toml"))
    assert "not found" in msg and "nope.toml" in msg


def test_config_file_given_twice_is_one_file_or_refused(tmp_path, monkeypatch):
    first = write(tmp_path, "[training]\nsteps = 3\n")
    second = tmp_path / "other.toml"
    second.write_text("[training]\nsteps = 7\n")
    # Two different files (the second one missing, or present): neither is read, one line names both.
    for other in (str(tmp_path / "missing.toml"), str(second)):
        (msg,) = problems("--job.config_file", first, f"--job.config_file={other}")
        assert msg.startswith("--job.config_file is given 2 times, naming 2 different files") and first in msg
        assert other in msg
    assert len(problems("--job.config_file", first, "--job.config_file", "none")) == 1  # none is no file
    (msg,) = problems("--job.config_file=", "--training.steps=2")
    assert msg.startswith("--job.config_file is empty")
    # The same file by two paths is one file: read, and the CLI still overrides it.
    monkeypatch.chdir(tmp_path)
    cfg = parse("--job.config_file", first, "--job.config_file", "./job.toml")
    assert cfg.training.steps == 3 and cfg.job.config_file == "./job.toml"


@pytest.mark.parametrize(
    "arg, needle",
    [
        ("--training.steps=0", "below the minimum"),
        ("--training.batch_size=-2", "below the minimum"),
        ("--parallelism.tensor_parallel_degree=0", "below the minimum"),
        ("--optimizer.name=SGD", "choose one of AdamW, Adam"),
        ("--activation_checkpoint.mode=some", "choose one of none, full, selective"),
        ("--lr_scheduler.lr_min=-0.5", "below the minimum"),
    ],
)
def test_out_of_range_values(arg, needle):
    msgs = problems(arg)
    assert len(msgs) == 1 and needle in msgs[0], msgs


def test_all_problems_reported_together():
    msgs = problems("--training.steps=x", "--training.batch_size=0", "--bogus.key=1")
    assert len(msgs) == 3


def test_value_missing_and_stray_argument():
    assert any("needs a value" in m for m in problems("--training.steps"))
    assert any("unexpected argument 'oops'" in m for m in problems("oops"))


# Values for fields whose type alone does not give a valid non-default value.
_CHANGED = {
    ("model", "flavor"): "8B",
    ("training", "seed_sharded_dims"): ["tp", "pp"],
    ("training", "global_batch_size"): 64,
    ("training", "dataset_path"): "data dir/with \"quotes\", a backslash \\ and ü",
    ("training", "dataset_mix"): [{"path": "web dir/ü", "weight": 0.7},
                                  {"dataset": "embedded", "weight": 0.3, "name": "docs", "validation_path": "v"}],
    ("optimizer", "betas"): [0.5, 0.125],
    ("optimizer", "muon_adamw_fqns"): ["layers.0.", "attention.wq ü"],
    ("lr_scheduler", "lr_min"): 0.1,
    ("lr_scheduler", "decay_ratio"): 0.3,
    ("parallelism", "data_parallel_shard_degree"): 4,
    ("parallelism", "pipeline_parallel_split_points"): ["layers.2", "layers.4"],
    ("checkpoint", "exclude_from_loading"): ["optimizer", "dataloader"],
    ("activation_checkpoint", "selective_ac_option"): "op",
    ("eval", "tasks"): ["continuation", "tasks dir/arc_easy ü.jsonl"],
    ("model", "converters"): ["float8"],
    ("float8", "filter_fqns"): ["output", "layers.0."],
    # Excludes validation.dataset/dataset_path (set below): round-tripped on its own in the test.
    ("validation", "held_out_fraction"): None,
    ("debug", "inject_nonfinite_grad"): [5, 9],
}


def _changed_value(section: str, key: str, f, default):
    """A valid value for the field that differs from its default."""
    if (section, key) in _CHANGED:
        return _CHANGED[(section, key)]
    choices = f.metadata.get("choices")
    if choices:
        return next((c for c in choices if c != default), default)
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 3
    if isinstance(default, float):
        return default * 3 + 1e-7  # a value whose shortest repr has many digits
    if isinstance(default, str) or default is None:
        hint = str(f.type)
        if "float" in hint:
            return 0.25
        return 7 if "int" in hint else f"{section}-{key}-ü"
    raise AssertionError(f"no rule for {section}.{key} (default {default!r})")


def test_effective_config_round_trips_through_toml_for_every_field(tmp_path):
    """Every field set away from its default: the written config.toml parses back to the same config."""
    import dataclasses

    from torchtitan.config import JobConfig

    cfg = JobConfig()
    for section in dataclasses.fields(cfg):
        values = getattr(cfg, section.name)
        for f in dataclasses.fields(values):
            if (section.name, f.name) != ("job", "config_file"):  # set by the reader below
                setattr(values, f.name, _changed_value(section.name, f.name, f, getattr(values, f.name)))
    for variant in ("validate on a dataset", "validate on a held-out fraction"):
        if variant.endswith("fraction"):
            cfg.validation.dataset = cfg.validation.dataset_path = None
            cfg.validation.held_out_fraction = 0.25
        path = tmp_path / "effective.toml"
        path.write_text(to_toml(cfg))
        tomllib.loads(path.read_text())  # valid TOML
        again = parse("--job.config_file", str(path))
        assert again.to_dict() == {**cfg.to_dict(), "job": {**cfg.to_dict()["job"], "config_file": str(path)}}, variant
    # Unset values are left out and parse back as unset (the defaults).
    defaults = parse("--job.config_file", str(write(tmp_path, to_toml(JobConfig()))))
    assert defaults.training.seed is None and defaults.lr_scheduler.decay_ratio is None


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN", "1e999"])
def test_non_finite_floats_are_rejected_on_the_cli_and_in_toml(tmp_path, value):
    assert problems(f"--training.max_norm={value}") == [
        f"--training.max_norm: '{value}' is not a finite number (expected float)"]
    toml_value = {"NaN": "nan", "1e999": "inf"}.get(value, value)
    found = problems("--job.config_file", write(tmp_path, f"[optimizer]\nlr = {toml_value}\n"))
    assert len(found) == 1 and "[optimizer] lr" in found[0] and "not a finite number" in found[0], found
    found = problems(f"--optimizer.betas=0.9,{value}")
    assert len(found) == 1 and "not a finite number" in found[0], found


# Every shipped config and its family: a new file in train_configs/ fails the listing check until added here.
SHIPPED_FAMILIES = {"debug_model": "llama3", "debug_model_ci": "llama3", "llama3_8b": "llama3",
                    "llama3_70b": "llama3", "llama3_405b": "llama3", "qwen3_debug_moe": "qwen3",
                    "qwen3_30b_a3b": "qwen3", "mixtral_8x7b": "mixtral", "gpt_oss_debug": "gpt_oss",
                    "gpt_oss_20b": "gpt_oss", "gpt_oss_120b": "gpt_oss", "deepseek_v3_debug": "deepseek_v3",
                    "deepseek_v3_16b": "deepseek_v3", "deepseek_v3_671b": "deepseek_v3", "kimi_k2": "deepseek_v3"}


def test_every_shipped_config_is_listed():
    assert sorted(p.stem for p in (REPO / "train_configs").glob("*.toml")) == sorted(SHIPPED_FAMILIES)


@pytest.mark.parametrize("name", sorted(SHIPPED_FAMILIES))
def test_shipped_configs_parse(name):
    from torchtitan.models import model_flavors

    cfg = parse("--job.config_file", str(REPO / "train_configs" / f"{name}.toml"))
    assert cfg.model.name == SHIPPED_FAMILIES[name]
    assert cfg.model.flavor in model_flavors(cfg.model.name), cfg.model.flavor


def _run_train(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, str(REPO / "train.py"), *args], capture_output=True, text=True, timeout=120, env=env
    )


@pytest.mark.slow
def test_help_lists_every_option():
    out = _run_train("--help")
    assert out.returncode == 0
    manager, written = ConfigManager(), config_help()  # the registry writes the model name's and flavor's lines
    for section, keys in manager.fields.items():
        for key, (f, _) in keys.items():
            assert f"--{section}.{key}" in out.stdout
            assert written.get(f"{section}.{key}", f.metadata["help"]) in out.stdout


@pytest.mark.slow
def test_config_error_is_one_line_per_problem_and_nonzero_exit():
    out = _run_train("--training.stpes=3", "--training.steps=x")
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 2, out.stderr
    assert "Traceback" not in out.stderr


def test_validation_config_errors():
    assert problems("--validation.freq=0") == ["--validation.freq: 0 is below the minimum 1"]
    assert problems("--validation.freq=-3") == ["--validation.freq: -3 is below the minimum 1"]
    cfg = parse("--validation.enable", "--validation.held_out_fraction=0.01", "--validation.steps=-1")
    assert cfg.validation.enable and cfg.validation.freq == 500 and cfg.validation.batch_size is None
    assert "--validation.held_out_fraction (float or unset)" in ConfigManager().help_text()


def test_a_field_annotation_the_parser_cannot_read_is_refused():
    from typing import Literal

    from torchtitan.config.manager import _field_type

    with pytest.raises(TypeError, match=r"config field annotation typing.Literal\['a'\]: the parser reads int"):
        _field_type(Literal["a"])
    assert _field_type(int | None).base is int and _field_type(list[str]).is_list
