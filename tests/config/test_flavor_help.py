"""``--help`` lists every registered family with its flavors (issue 60: it listed Llama 3's alone, by hand).

The model registry writes those two lines (``registry.config_help``) and train.py hands them to the config
manager: the config module cannot import the registry, whose families import it.
"""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

import train
from torchtitan.config import ConfigManager
from torchtitan.models.registry import model_flavors, model_names


def _help_line(text: str, option: str) -> str:
    lines = text.splitlines()
    return lines[lines.index(f"  --{option} (str)") + 1]


def test_train_help_lists_every_family_and_its_flavors(capsys):
    assert train.main(["--help"]) == 0
    out = capsys.readouterr().out
    flavor_line = _help_line(out, "model.flavor")
    for name in model_names():
        assert f"{name}: {', '.join(model_flavors(name))}" in flavor_line, (name, flavor_line)
    assert f"names it: {', '.join(model_names())} (default: llama3)" in _help_line(out, "model.name")


def test_help_text_takes_written_lines_and_keeps_the_others():
    text = ConfigManager().help_text({"model.name": "written here"})
    assert _help_line(text, "model.name") == "      written here (default: llama3)"
    assert "or a release to read the shape from (default: debugmodel)" in _help_line(text, "model.flavor")


def test_the_config_package_imports_no_model_module():
    for path in (Path(REPO) / "torchtitan" / "config").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("torchtitan.models"), (path.name, node.module)
