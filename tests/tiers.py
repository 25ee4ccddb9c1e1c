"""The two test tiers: ``pytest -m "not slow"`` (fast, no process spawned) and everything.

A test is ``slow`` when it starts a process: a gloo world (``dist_harness.run_ranks``),
torchrun, ``train.py`` or a script in a subprocess. It says so where it is written: a module
whose every test starts processes carries ``pytestmark = pytest.mark.slow``; a single test
carries ``@pytest.mark.slow``. A test that starts nothing but takes long may carry it too.

The fast tier checks the marks: while slow tests are deselected, a test that starts a process
anyway fails with a message naming it, so a new spawning test cannot quietly make the fast
tier slow. CI runs both tiers (no ``-m``), where nothing is checked.
"""

from __future__ import annotations

import contextlib
import multiprocessing.process
import subprocess
from collections.abc import Callable, Iterator

import pytest


def _fast_tier(config: pytest.Config) -> bool:
    # Only a run that asked for the fast tier is checked; the full run (CI) spawns freely.
    return "not slow" in (config.option.markexpr or "")


def _refuse(what: str) -> Callable[..., None]:
    def start(*args: object, **kwargs: object) -> None:
        # pytest.fail raises a BaseException: no ``except Exception`` or ``pytest.raises`` in the
        # test can take it for the failure it expects.
        pytest.fail(
            f"this test starts a process ({what}) but is not marked slow: mark it @pytest.mark.slow "
            "(or its module `pytestmark = pytest.mark.slow`; see tests/tiers.py) so that "
            "`pytest -m 'not slow'` stays fast",
            pytrace=False,
        )
    return start


@contextlib.contextmanager
def _guarded(item: pytest.Item) -> Iterator[None]:
    """Refuse process starts while ``item`` (and its fixtures, of any scope) sets up and runs."""
    if not _fast_tier(item.config) or item.get_closest_marker("slow") is not None:
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "__init__", _refuse("subprocess"))
        patch.setattr(multiprocessing.process.BaseProcess, "start", _refuse("multiprocessing"))
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    with _guarded(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with _guarded(item):
        yield
