"""What the whole test suite shares: the repository root, the shipped tokenizer and free ports.

Fixtures serve the test functions. Code that runs where no fixture reaches (a function
spawned on ranks, a module-level helper) imports the constants: ``from conftest import REPO``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from torchtitan.distributed.lifecycle import free_port as _free_port

REPO = Path(__file__).resolve().parents[1]
# The SentencePiece tokenizer that ships with the package (2048 words), absolute so that a
# test passes from any working directory.
SHIPPED_TOKENIZER = str(REPO / "torchtitan" / "datasets" / "assets" / "tokenizer.model")


@pytest.fixture(scope="session")
def shipped_tokenizer() -> str:
    """Path of the tokenizer that ships with the package."""
    return SHIPPED_TOKENIZER


@pytest.fixture
def free_port() -> Callable[[], int]:
    """Call it for a TCP port that is free now (one call per rendezvous)."""
    return _free_port
