"""``--model.flavor``'s help lists every registered family with its flavors, written from the registry when
``--help`` reads it (issue 60: it listed Llama 3's alone, by hand)."""

from __future__ import annotations

from torchtitan.config import ConfigManager
from torchtitan.config.job_config import HelpWrittenOnUse
from torchtitan.models.registry import model_flavors, model_names


def test_flavor_help_lists_every_family_and_its_flavors():
    lines = ConfigManager().help_text().splitlines()
    help_line = lines[lines.index("  --model.flavor (str)") + 1]
    for name in model_names():
        assert f"{name}: {', '.join(model_flavors(name))}" in help_line, (name, help_line)


def test_family_help_lists_every_family():
    lines = ConfigManager().help_text().splitlines()
    help_line = lines[lines.index("  --model.name (str)") + 1]
    assert f"names it: {', '.join(model_names())} (default: llama3)" in help_line, help_line


def test_the_help_is_written_when_first_read_and_once():
    written: list[str] = []

    def write() -> str:
        written.append("help")
        return "the help"

    meta = HelpWrittenOnUse({"choices": None, "min": 0}, write)
    assert meta.get("choices") is None and meta["min"] == 0 and sorted(meta) == ["choices", "help", "min"]
    assert written == []  # parsing reads the checks only: the registry is not imported for it
    assert meta["help"] == meta["help"] == "the help" and written == ["help"]
