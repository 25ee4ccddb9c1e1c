"""Leaving a job: a rank that fails first must not cut off a slower peer's report under torchrun."""

from __future__ import annotations

import pytest
from conftest import DEBUG_CONFIG, run_torchrun

pytestmark = pytest.mark.slow  # every test here starts processes

DEBUG = DEBUG_CONFIG

# Rank 0 reaches its check 3 s late; rank 1 at once. "train": both go through train.py's main with an
# unknown option (a config error, exit 2). "bare": the same line and exit with no wait, the control.
_LAUNCH = """
import os, sys, time
rank = int(os.environ["RANK"])
if rank == 0:
    time.sleep(3)
if sys.argv[1] == "train":
    import train
    sys.exit(train.main(sys.argv[2:]))
print(f"config error: seen by rank {rank}", file=sys.stderr, flush=True)
sys.exit(2)
"""


@pytest.mark.parametrize("mode", ["bare", "train"])
def test_every_rank_prints_its_config_error_before_torchrun_stops_the_job(tmp_path, mode):
    script = tmp_path / "launch.py"
    script.write_text(_LAUNCH)
    out = run_torchrun(script, mode, "--job.config_file", DEBUG, f"--job.dump_folder={tmp_path}",
                       "--training.bogus=1", launch=["--monitor-interval=0.1"], timeout=120)
    assert out.returncode != 0
    lines = out.stderr.count("config error:")
    if mode == "train":  # rank 1 waited for rank 0's line before it exited
        assert lines == 2, out.stderr[-2000:]
        assert out.stderr.count("unknown option --training.bogus") == 2, out.stderr[-2000:]
    else:  # the race the wait closes: torchrun stopped rank 0 while it was still asleep
        assert lines == 1 and "seen by rank 1" in out.stderr, out.stderr[-2000:]
