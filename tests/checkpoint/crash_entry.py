"""``train.py`` in which rank 0 dies by SIGKILL in the middle of saving step ``$CRASH_AT_STEP``.

It dies after writing its own data files and before the save is complete, the
moment a real crash would leave a half-written checkpoint behind. A save into an object
store is written straight into ``step-N`` (no ``.tmp``): ``CRASH_IN_FOLDER`` names it.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

_CRASH_DIR = os.environ.get("CRASH_IN_FOLDER", f"step-{os.environ['CRASH_AT_STEP']}.tmp")
_write_data = dcp.FileSystemWriter.write_data


def _write_then_die(self, plan, planner):
    future = _write_data(self, plan, planner)
    if os.environ.get("RANK") == "0" and Path(str(self.path)).name == _CRASH_DIR:
        future.wait()
        os.kill(os.getpid(), signal.SIGKILL)
    return future


dcp.FileSystemWriter.write_data = _write_then_die

if __name__ == "__main__":
    import train

    sys.exit(train.main())
