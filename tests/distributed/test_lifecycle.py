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


# One process makes its group twice (a test training two runs, a notebook). Between the two, another
# job listens on the port the first group's store had: the second group must not go back to that port.
_TWICE = """
import os, socket
from torchtitan.distributed.lifecycle import init_distributed, shutdown_distributed
init_distributed(60)
first = int(os.environ["MASTER_PORT"])
shutdown_distributed(ok=True, timeout_seconds=10)
squatter = socket.socket()
squatter.bind(("127.0.0.1", first))
squatter.listen()
rank, world, _ = init_distributed(60)
print("second group", rank, world, int(os.environ["MASTER_PORT"]) != first)
"""


def test_one_process_makes_its_group_twice_on_a_fresh_port(tmp_path):
    import subprocess
    import sys

    from conftest import REPO, torchrun_env

    out = subprocess.run([sys.executable, "-c", _TWICE], cwd=REPO, env=torchrun_env(), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "second group 0 1 True" in out.stdout, out.stdout + out.stderr[-2000:]
