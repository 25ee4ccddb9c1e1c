"""docs/configuration.md describes the config as it is: its sections table has one row for each section of
``JobConfig``, in ``JobConfig``'s order (that of ``--help``), and its Shipped configs list names every file in
``train_configs/`` and no other. A new section or config passes by adding its row or its line.
"""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest
from conftest import REPO

from torchtitan.config.job_config import JobConfig

SECTION_ROW = re.compile(r"^\| `\[(\w+)\]` \|", re.MULTILINE)
CONFIG_NAME = re.compile(r"`([\w.-]+\.toml)`")


def documented_configs(doc: str) -> set[str]:
    """The ``name.toml`` files the list items of the Shipped configs section name."""
    section = doc.split("\n## Shipped configs\n", 1)[1].split("\n## ", 1)[0]
    items = [line for line in section.splitlines() if line.startswith(("- ", "  "))]
    return {name for line in items for name in CONFIG_NAME.findall(line)}


def doc_problems(doc: str, root: Path) -> list[str]:
    sections = SECTION_ROW.findall(doc)
    wanted = [f.name for f in fields(JobConfig)]
    problems = [f"the sections table has no row for [{name}]" for name in wanted if name not in sections]
    problems += [f"the sections table names [{name}], which JobConfig does not have" for name in sections
                 if name not in wanted]
    if not problems and sections != wanted:
        problems.append(f"the sections table is not in JobConfig's order: {sections} (JobConfig: {wanted})")
    shipped = {p.name for p in (root / "train_configs").glob("*.toml")}
    listed = documented_configs(doc)
    problems += [f"the Shipped configs list has no line for {name}" for name in sorted(shipped - listed)]
    problems += [f"the Shipped configs list names {name}, which is not in train_configs/" for name in
                 sorted(listed - shipped)]
    return problems


def test_the_configuration_doc_matches_the_config_and_the_shipped_files():
    assert doc_problems((REPO / "docs" / "configuration.md").read_text(), REPO) == []


@pytest.mark.parametrize("edit, expected", [
    (lambda t: re.sub(r"\n\| `\[moe\]`[^\n]*", "", t), "no row for [moe]"),
    (lambda t: t.replace("`[debug]`", "`[debugging]`"), "names [debugging]"),
    (lambda t: t.replace("`kimi_k2.toml`", "`kimi_k3.toml`"), "no line for kimi_k2.toml"),
    (lambda t: t.replace("`kimi_k2.toml`", "`kimi_k3.toml`"), "names kimi_k3.toml"),
])
def test_the_check_fails_on_a_stale_or_missing_entry(edit, expected):
    problems = doc_problems(edit((REPO / "docs" / "configuration.md").read_text()), REPO)
    assert any(expected in p for p in problems), problems
