"""The console lines are an interface: what the trainer prints, the declared patterns read back."""

from __future__ import annotations

import ast
import logging

import pytest

from torchtitan.logging_setup import init_logger
from torchtitan.metrics.logger import (
    BATCH_LINE,
    MESH_LINE,
    STEP_LINE,
    VALIDATION_LINE,
    format_batch_line,
    format_mesh_line,
    format_step_line,
    format_validation_line,
)


@pytest.fixture
def printed(capsys):
    """Log messages through the project's own handler (as rank 3) and return what it printed."""
    def emit(*messages: str) -> str:
        init_logger(rank=3)
        for message in messages:
            logging.getLogger("torchtitan.trainer").info(message)
        return capsys.readouterr().err
    yield emit
    logging.getLogger().handlers.clear()


def test_step_validation_and_mesh_lines_read_back(printed):
    out = printed(
        format_mesh_line(("dp_replicate", "dp_shard", "tp"), (2, 2, 2)),
        format_step_line(12, {"loss": 7.123456, "grad_norm": 1.5, "lr": 3e-4, "tps": 1234.0, "peak_rss_gib": 1.0}),
        format_validation_line(12, 6.54321, 695.2, 4096, 2, 1_000_000),
        format_batch_line(100, 8, 2048, 4, 16),
    )
    (step,) = STEP_LINE.findall(out)
    assert step == ("3", "12", "7.1235")  # rank, step, loss to the 5 digits printed
    (validation,) = VALIDATION_LINE.findall(out)
    assert validation == ("3", "12", "6.5432")
    (rank, mesh), = MESH_LINE.findall(out)
    assert rank == "3" and ast.literal_eval(mesh) == {"dp_replicate": 2, "dp_shard": 2, "tp": 2}
    # The trainer's statement of its batch arithmetic (scripts/loss_compare.py reads it).
    assert BATCH_LINE.findall(out) == [("8", "2048", "4", "16")]
    # A validation line is not a step line (the matrix counts training steps with STEP_LINE).
    assert len(STEP_LINE.findall(out)) == 1


def test_downstream_scores_and_validation_bpb_end_their_lines(printed):
    metrics = {"loss": 3.0, "eval/continuation/acc": 0.3125, "eval/continuation/acc_norm": 0.28,
               "eval/continuation/bpb": 2.1234, "eval/my/task/acc": 1.0}
    out = printed(format_step_line(40, metrics), format_validation_line(40, 3.2, 24.5, 128, 1, 2560, bpb=1.875))
    assert STEP_LINE.findall(out) == [("3", "40", "3")]
    assert "eval: continuation acc 0.3125 acc_norm 0.28 bpb 2.123 | my/task acc 1" in out
    assert VALIDATION_LINE.findall(out) == [("3", "40", "3.2")] and "bpb: 1.875" in out
