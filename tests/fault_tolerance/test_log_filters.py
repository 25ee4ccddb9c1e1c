"""quiet_torchft drops torchft's flight-recorder warning only where torch lacks the reset it asks for."""

from __future__ import annotations

import logging

import pytest

from torchtitan.fault_tolerance import log_filters


@pytest.mark.parametrize("reset_exists", [False, True])
def test_flight_recorder_warning_dropped_only_without_the_reset(monkeypatch, reset_exists):
    logger = logging.getLogger("torchft.manager")
    monkeypatch.setattr(logger, "filters", [])
    monkeypatch.setattr(log_filters, "flight_recorder_reset_exists", lambda: reset_exists)
    log_filters.quiet_torchft()
    record = logger.makeRecord(logger.name, logging.WARNING, __file__, 0, log_filters.FLIGHT_RECORDER, (), None)
    assert bool(logger.filter(record)) == reset_exists
