"""torchtitan/agent_watch.py in this process: a rank whose torchrun agent is gone neither commits nor runs on.

The whole thing, a killed launcher and its two ranks, is ``tests/scripts/test_launcher.py``; here the
process's exit is replaced by an exception, so that what would have happened before it can be checked.
"""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest

from torchtitan import agent_watch
from torchtitan.checkpoint.saver import Saver


class _Exited(Exception):
    pass


def _raise_exit(status: int) -> None:
    raise _Exited(status)


@pytest.fixture
def orphaned(monkeypatch):
    """This process as a rank whose recorded agent is not its parent any more; ``os._exit`` raises ``_Exited``."""
    monkeypatch.setattr(agent_watch, "_agent_pid", os.getppid() + 1)
    monkeypatch.setattr(agent_watch.os, "_exit", _raise_exit)


def test_a_rank_whose_agent_is_gone_commits_no_checkpoint(tmp_path, orphaned, caplog):
    tmp = tmp_path / "step-3.tmp"
    tmp.mkdir()
    (tmp / ".metadata").write_bytes(b"written by every rank")
    ck = SimpleNamespace(export_dtype="float32", keep_latest_k=0)
    states = SimpleNamespace(names=lambda model_only: ["model"])
    saver = Saver(ck, tmp_path, states, agreement=SimpleNamespace(group=None), rank=0, layout={})  # type: ignore[arg-type]
    with caplog.at_level(logging.ERROR), pytest.raises(_Exited) as exited:
        saver._commit(3, "full", 0.0, writer=object())  # type: ignore[arg-type]
    assert exited.value.args == (agent_watch.ORPHANED_EXIT_STATUS,)
    assert not (tmp_path / "step-3").exists() and tmp.is_dir()  # never renamed into a committed step
    (line,) = [r.getMessage() for r in caplog.records if r.name == agent_watch.__name__]
    assert "torchrun's agent (pid" in line and "without saving a checkpoint" in line


def test_the_watch_stops_an_orphan_and_runs_only_under_torchrun(orphaned, monkeypatch):
    with pytest.raises(_Exited):
        agent_watch._poll(os.getppid() + 1, poll_seconds=0.01)
    monkeypatch.setattr(agent_watch, "_agent_pid", None)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert agent_watch.watch_agent() is False and agent_watch._agent_pid is None  # plain python train.py: no agent
