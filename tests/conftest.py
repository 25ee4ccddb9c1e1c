"""What the whole test suite shares: the repository root, the shipped tokenizer and free ports.

Fixtures serve the test functions. Code that runs where no fixture reaches (a function
spawned on ranks, a module-level helper) imports the constants: ``from conftest import REPO``,
and ``load_script`` imports a script of the repository as a module.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from torchtitan.distributed.lifecycle import free_port as _free_port

REPO = Path(__file__).resolve().parents[1]
# The SentencePiece tokenizer that ships with the package (2048 words), absolute so that a
# test passes from any working directory.
SHIPPED_TOKENIZER = str(REPO / "torchtitan" / "datasets" / "assets" / "tokenizer.model")


def load_script(relative_path: str) -> ModuleType:
    """A script of the repository (``scripts/x.py``, ``tests/x.py``) imported as a module, once.

    Registered in ``sys.modules`` under its file name: dataclasses look their module up
    while a class is built, and a second load would give a second copy of each class.
    """
    path = REPO / relative_path
    if path.stem in sys.modules:
        return sys.modules[path.stem]
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def shipped_tokenizer() -> str:
    """Path of the tokenizer that ships with the package."""
    return SHIPPED_TOKENIZER


@pytest.fixture
def free_port() -> Callable[[], int]:
    """Call it for a TCP port that is free now (one call per rendezvous)."""
    return _free_port


# The fast tier's check: a test that starts a process without the slow mark fails there.
from tiers import pytest_runtest_call, pytest_runtest_setup  # noqa: E402,F401 - pytest finds hooks by name
