"""A release's ``config.json`` both ways from each family's table of rows (models/common/hf_config.py).

A row reads the first key present, its default when the entry is missing (or false, where the family's
configs read ``x or default``) or a value derived from the others; each family but Llama 3 (whose fields
are shared with Meta's ``params.json``, ``llama3/convert.py``) translates through one table; a written
config reads back as the model it describes; a null entry is a difference named in one line.
"""

from __future__ import annotations

import json

import pytest
import torch

from torchtitan.models import get_model_spec
from torchtitan.models.common.hf import DecoderHFAdapter
from torchtitan.models.common.hf_config import ConfigField, ConfigTable, HFDecoderConfig

TABLE_FAMILIES = [("qwen3", "debugmodel"), ("qwen3", "debugmodel_moe"), ("mixtral", "debugmodel"),
                  ("deepseek_v3", "debugmodel"), ("gpt_oss", "debugmodel")]


def _table(family: str) -> ConfigTable:
    adapter = get_model_spec(family).state_dict_adapter
    assert isinstance(adapter, DecoderHFAdapter)
    config = adapter.config
    table = config.table if isinstance(config, HFDecoderConfig) else config
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
