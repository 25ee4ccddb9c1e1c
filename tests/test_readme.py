"""The README's Layout section describes the tree as it is.

Its code block has one entry a line that starts at column 0 (a path, then what it holds); lines that
start with spaces continue the entry above. Every entry's path exists; every package of ``torchtitan/``
(a folder with ``__init__.py``) and every top-level module of it has an entry; and every file an entry
names (``name.py``, ``name.toml``, ``name.sh``, with ``{a,b}`` alternatives) exists under the entry's path
(or, written with a folder, from the repository's root).
A new package passes by adding its line.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
from conftest import REPO

FILE = re.compile(r"[\w/{},.-]*\.(?:py|toml|sh)\b")


def layout_entries(readme: str) -> dict[str, str]:
    """``{path: description}`` of the Layout section's code block."""
    section = readme.split("\n## Layout\n", 1)[1]
    block = section.split("```", 2)[1]
    entries: dict[str, str] = {}
    path = None
    for line in block.splitlines()[1:]:
        if not line.strip():
            continue
        if line[0].isspace():
            assert path is not None, f"a continuation line before any entry: {line!r}"
            entries[path] += " " + line.strip()
        else:
            path, _, text = line.partition(" ")
            entries[path] = text.strip()
    return entries


def _expand(name: str) -> list[str]:
    """``llama3_{8b,70b}.toml`` -> ``llama3_8b.toml``, ``llama3_70b.toml``."""
    parts = re.split(r"\{([^}]*)\}", name)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def layout_problems(readme: str, root: Path) -> list[str]:
    entries = layout_entries(readme)
    problems = [f"the Layout section names {path}, which does not exist" for path in entries
                if not (root / path).exists()]
    package = root / "torchtitan"
    wanted = [f"{init.parent.relative_to(root).as_posix()}/" for init in package.rglob("__init__.py")
              if init.parent != package]
    wanted += [m.relative_to(root).as_posix() for m in package.glob("*.py") if m.name != "__init__.py"]
    problems += [f"the Layout section has no line for {path}" for path in sorted(wanted) if path not in entries]
    for path, text in entries.items():
        base = root / path
        if not base.is_dir():
            continue
        for token in FILE.findall(text):
            for name in _expand(token.strip(",.")):
                if not ((base / name).exists() or (root / name).exists() or any(base.rglob(Path(name).name))):
                    problems.append(f"the Layout line of {path} names {name}, which is not under it")
    return problems


def test_the_layout_section_matches_the_tree():
    assert layout_problems((REPO / "README.md").read_text(), REPO) == []


@pytest.mark.parametrize("edit, expected", [
    (lambda t: t.replace("torchtitan/generation/", "torchtitan/generator/"), "names torchtitan/generator/"),
    (lambda t: t.replace("torchtitan/planning/clusters/", "torchtitan/planning/"), "no line for "
                                                                                   "torchtitan/planning/clusters/"),
    (lambda t: re.sub(r"\ntorchtitan/batch\.py[^\n]*", "", t), "no line for torchtitan/batch.py"),
    (lambda t: t.replace("(weight_map.py)", "(weight_mapx.py)"), "names weight_mapx.py"),
])
def test_the_check_fails_on_a_stale_or_missing_line(edit, expected):
    problems = layout_problems(edit((REPO / "README.md").read_text()), REPO)
    assert any(expected in p for p in problems), problems
