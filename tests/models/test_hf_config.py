"""A release's ``config.json`` both ways from each family's table of rows (models/common/hf_config.py).

A row reads the first key present, its default when the entry is missing (or false, where the family's
configs read ``x or default``) or a value derived from the others; each family translates through one
table (Llama 3's fields are also those of Meta's ``params.json``, ``llama3/convert.py``); a written
config reads back as the model it describes; a null entry is a difference named in one line.
"""

from __future__ import annotations

import json

import pytest
import torch

from torchtitan.models import get_model_spec
from torchtitan.models.common.hf import DecoderHFAdapter
from torchtitan.models.common.hf_config import ConfigField, ConfigTable

TABLE_FAMILIES = [("qwen3", "debugmodel"), ("qwen3", "debugmodel_moe"), ("mixtral", "debugmodel"),
                  ("deepseek_v3", "debugmodel"), ("gpt_oss", "debugmodel"), ("llama3", "debugmodel_tied"),
                  ("llama3", "1B")]


def _table(family: str) -> ConfigTable:
    adapter = get_model_spec(family).state_dict_adapter
    assert isinstance(adapter, DecoderHFAdapter)
    config = adapter.config
    table = getattr(config, "table", config)  # HFDecoderConfig, Llama 3's LlamaConfigFormat: their table
    assert isinstance(table, ConfigTable), f"{family}'s config.json is translated by hand ({type(config).__name__})"
    return table


def test_a_row_reads_the_first_present_key_its_default_or_a_derived_value():
    row = ConfigField("n", ("a", "b"), default=7, kind=int, falsy_default=True)
    assert row.read({"b": "3"}) == 3 and row.read({}) == 7
    assert row.read({"a": 0, "b": 5}) == 7  # the first present key decides, as ``c.get(a, c.get(b)) or 7``
    derived = ConfigField("n", ("a",), falsy_default=True, derive=lambda c: c["width"] // 2)
    assert derived.read({"a": None, "width": 8}) == 4 and derived.read({"a": 3, "width": 8}) == 3
    with pytest.raises(KeyError, match="'a'"):
        ConfigField("n", ("a",)).read({"b": 1})


@pytest.mark.parametrize("family, flavor", TABLE_FAMILIES)
def test_a_written_config_reads_back_as_the_model_it_describes(family, flavor, tmp_path):
    spec, table = get_model_spec(family), _table(family)
    args = spec.flavors[flavor]
    config = spec.state_dict_adapter.hf_config(args, bos_id=1, eos_id=2, dtype=torch.bfloat16)
    assert spec.state_dict_adapter.hf_config_problems(args, config, "config.json") == []
    (tmp_path / "config.json").write_text(json.dumps(config))
    back = spec.read_release(str(tmp_path))
    assert table.compared(back) == table.compared(args) and back.max_seq_len == args.max_seq_len
    expert_keys = [row.written_key for row in table.rows if row.of_experts and row.written_key]
    assert all((key in config) == bool(args.num_experts) for key in expert_keys)  # a dense model names none


def test_a_null_entry_is_a_difference_named_in_one_line():
    """GPT-OSS compared args built of the release, which a null width broke with a TypeError in preflight."""
    spec = get_model_spec("gpt_oss")
    args = spec.flavors["debugmodel"]
    config = spec.state_dict_adapter.hf_config(args, bos_id=None, eos_id=None, dtype=torch.float32)
    config["num_attention_heads"] = None
    problems = spec.state_dict_adapter.hf_config_problems(args, config, "DIR/config.json")
    assert problems == [f"DIR/config.json: n_heads is None there, {args.n_heads} in the configured model"]


@pytest.mark.parametrize("flavor", ["debugmodel", "1B", "8B"])
def test_llama3_writes_the_released_layout_and_reads_back_every_field(flavor, tmp_path):
    """Llama 3's table keeps its exports' key order and its fields shared with ``params.json`` (the rotary scaling's
    parameters, the SwiGLU width) through a write and a read."""
    from torchtitan.models.llama3.convert import model_fields

    spec, table = get_model_spec("llama3"), _table("llama3")
    args = spec.flavors[flavor]
    config = spec.state_dict_adapter.hf_config(args, bos_id=None, eos_id=3, dtype=torch.float32)
    assert tuple(config) == table.order and config["rope_scaling"] == (None if flavor == "debugmodel" else {
        "rope_type": "llama3", "factor": args.rope_scaling_factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})
    (tmp_path / "config.json").write_text(json.dumps(config))
    back = spec.read_release(str(tmp_path))
    assert model_fields(back) == model_fields(args) and back.max_seq_len == args.max_seq_len
    config["rope_scaling"] = None
    problems = spec.state_dict_adapter.hf_config_problems(args, config, "DIR/config.json")
    assert problems == ([] if flavor == "debugmodel" else [
        f"DIR/config.json: rope scaling (rope_scaling) is None there, {model_fields(args)['rope_scaling']!r} in the "
        "configured model"])
