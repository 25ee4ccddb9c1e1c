"""The fast tier's check: with slow tests deselected, a test that starts a process unmarked fails.

Runs an inner pytest session in this process on four small tests. In the fast tier nothing is
started; the full run does start its processes, so that test is marked slow.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

_INNER_TESTS = '''
import multiprocessing
import subprocess
import sys

import pytest


def test_starts_a_subprocess_unmarked():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_starts_a_multiprocessing_process_unmarked():
    # A failure the test expects (except Exception) must not swallow the check.
    try:
        multiprocessing.get_context("spawn").Process(target=print).start()
    except Exception:
        pass


@pytest.mark.slow
def test_marked_slow():
    raise AssertionError("deselected in the fast tier, never run")


def test_starts_nothing():
    assert sum(range(4)) == 6
'''


class _Outcomes:
    """Records each inner test's outcome and failure text."""

    def __init__(self) -> None:
        self.outcome: dict[str, str] = {}
        self.text: dict[str, str] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        name = report.nodeid.rsplit("::", 1)[-1]
        if report.failed or report.when == "call":
            self.outcome[name] = report.outcome
            self.text[name] = report.longreprtext


def _run_inner(folder: Path, monkeypatch: pytest.MonkeyPatch, *args: str) -> _Outcomes:
    (folder / "conftest.py").write_text(textwrap.dedent('''
        from tiers import pytest_runtest_call, pytest_runtest_setup  # noqa: F401


        def pytest_configure(config):
            config.addinivalue_line("markers", "slow: starts processes")
    '''))
    (folder / "test_inner.py").write_text(_INNER_TESTS)
    outcomes = _Outcomes()
    # Installed plugins stay out: some start processes of their own at start-up (git, for one).
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytest.main([str(folder), "-q", "-p", "no:cacheprovider", "--rootdir", str(folder), "--import-mode=importlib",
                 *args], plugins=[outcomes])
    return outcomes


def test_fast_tier_fails_an_unmarked_test_that_starts_a_process(tmp_path, monkeypatch):
    got = _run_inner(tmp_path, monkeypatch, "-m", "not slow")
    assert got.outcome == {"test_starts_a_subprocess_unmarked": "failed",
                           "test_starts_a_multiprocessing_process_unmarked": "failed",
                           "test_starts_nothing": "passed"}
    assert "starts a process (subprocess) but is not marked slow" in got.text["test_starts_a_subprocess_unmarked"]
    assert "mark it @pytest.mark.slow" in got.text["test_starts_a_multiprocessing_process_unmarked"]


@pytest.mark.slow
def test_full_run_lets_every_test_start_processes(tmp_path, monkeypatch):
    got = _run_inner(tmp_path, monkeypatch, "-k", "not test_marked_slow")
    assert got.outcome == {"test_starts_a_subprocess_unmarked": "passed",
                           "test_starts_a_multiprocessing_process_unmarked": "passed",
                           "test_starts_nothing": "passed"}
