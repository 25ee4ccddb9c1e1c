"""One log format for every rank: the rank is in each line, so interleaved output stays readable; a logged
exception ends with each process group's last collective, so that a timeout names the group it hung on."""

from __future__ import annotations

import logging
import os
import sys
from types import TracebackType

# Every line starts "[rank<R>] <HH:MM:SS> <LEVEL> ". Tools that read runs' console output
# (tests/integration_tests.py) match lines with this prefix and the line patterns of
# torchtitan/metrics/logger.py; tests/metrics/test_log_lines.py holds the two together.
LINE_PREFIX_RE = r"\[rank(\d+)\] \S+ INFO "

_ExcInfo = tuple[type[BaseException], BaseException, TracebackType | None] | tuple[None, None, None]


def init_logger(rank: int | None = None) -> None:
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    level = os.environ.get("LOG_LEVEL", "INFO").upper()
    handler = logging.StreamHandler()
    handler.setFormatter(RankFormatter(f"[rank{rank}] %(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


class RankFormatter(logging.Formatter):
    """The line format; after an exception's traceback, each process group's last collective (a timeout names
    the group it hung on)."""

    def formatException(self, ei: _ExcInfo) -> str:  # noqa: N802 - logging's name
        return super().formatException(ei) + last_collectives_note()


def last_collectives_note() -> str:
    """The last collective this rank started on each of its groups of several ranks, newest first, one line
    each after a newline ("" when none: one process, or no collective yet).

    A collective that times out or loses its peer fails with the backend's words only (gloo: "Timed
    out waiting 20000ms for recv operation to complete"), which do not say which process group it ran
    on; the group a rank hung on is the one whose last collective started about its timeout before.
    """
    if "torch.distributed" not in sys.modules:  # no collective can have run (a config error stays fast)
        return ""
    from torchtitan.compat import CompatError, last_collectives

    try:
        lines = last_collectives()
    except CompatError as e:  # the report of the failure matters more than this addition to it
        return f"\nThe last collective on each process group cannot be listed: {e}"
    if not lines:
        return ""
    return ("\nThe last collective on each process group, newest first (a hung one started about its timeout "
            "before this failure):\n  " + "\n  ".join(lines))
