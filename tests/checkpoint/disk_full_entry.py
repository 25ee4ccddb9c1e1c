"""``train.py`` on a small disk: a real one the test mounted, or one emulated here.

- ``SMALL_DISK_BYTES`` (set when the machine refuses mounts): the file system under
  ``--job.dump_folder`` is emulated to hold that many bytes. The free-space check reads
  the emulated free space, and a checkpoint write that would pass the limit fails with
  ENOSPC, as a real full disk fails it.
- ``UNDERESTIMATE=1``: the free-space check is told that every save is 1 byte. The check
  then passes, and a save that does not fit starts and meets the full disk while
  writing, as when another job fills a shared file system between the check and the write.
- ``SKEWED_ASYNC=1``: the ranks look at a pending async save out of step, as on a cluster:
  rank 0's quick look between steps waits until the save has finished, rank 1's sees nothing.
  A rank that stopped alone on a failed save would then leave rank 1 in the next step's
  collectives.
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from torchtitan.checkpoint import integrity, space  # noqa: E402


def _used(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


def _emulate_disk(root: Path, capacity: int) -> None:
    space.free_bytes = lambda folder: max(0, capacity - _used(root))
    write = integrity._HashingStream.write

    def bounded_write(self, b):
        if _used(root) + memoryview(b).nbytes > capacity:
            return self._guard(_raise_enospc)
        return write(self, b)

    integrity._HashingStream.write = bounded_write


def _raise_enospc():
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


if os.environ.get("SMALL_DISK_BYTES"):
    dump = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--job.dump_folder="))
    _emulate_disk(Path(dump), int(os.environ["SMALL_DISK_BYTES"]))
if os.environ.get("UNDERESTIMATE") == "1":
    space.previous_size = lambda folder, kind: 1
    space.state_sizes = lambda state: {"everything": 1}

if os.environ.get("SKEWED_ASYNC") == "1":
    import concurrent.futures

    from torchtitan.checkpoint.saver import Saver

    finish = Saver.finish_pending

    def skewed_finish(self, block=True, **kwargs):
        if not block and os.environ["RANK"] == "1":
            return None
        if not block and self.pending is not None:
            concurrent.futures.wait([self.pending.future], timeout=120)
        return finish(self, block, **kwargs)

    Saver.finish_pending = skewed_finish

if __name__ == "__main__":
    import train

    sys.exit(train.main())
