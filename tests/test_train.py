"""train.py's exit paths: a failure the user can act on is told in its one line, without a traceback."""

from __future__ import annotations

import logging

import train
from torchtitan.checkpoint.s3_client import StoreUnansweredError


def test_an_unanswering_store_ends_the_run_with_its_one_line(caplog):
    line = "save of step 2: the object store at http://127.0.0.1:9 did not answer; check the store"
    with caplog.at_level(logging.ERROR):
        status = train._failure_status(StoreUnansweredError(line))
    assert status == 1
    assert [(r.getMessage(), r.exc_info) for r in caplog.records] == [(line, None)]


def test_any_other_failure_keeps_its_traceback(caplog):
    try:
        raise ValueError("boom")
    except ValueError as e:
        with caplog.at_level(logging.ERROR):
            status = train._failure_status(e)
    assert status == 1
    assert [r.getMessage() for r in caplog.records] == ["Training failed"]
    assert caplog.records[0].exc_info is not None
