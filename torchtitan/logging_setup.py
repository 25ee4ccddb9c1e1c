"""One log format for every rank: the rank is in each line, so interleaved output stays readable."""

from __future__ import annotations

import logging
import os

# Every line starts "[rank<R>] <HH:MM:SS> <LEVEL> ". Tools that read runs' console output
# (tests/integration_tests.py) match lines with this prefix and the line patterns of
# torchtitan/metrics/logger.py; tests/metrics/test_log_lines.py holds the two together.
LINE_PREFIX_RE = r"\[rank(\d+)\] \S+ INFO "


def init_logger(rank: int | None = None) -> None:
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    level = os.environ.get("LOG_LEVEL", "INFO").upper()
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"[rank{rank}] %(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
