"""Leaving a job: a rank that fails first must not cut off a slower peer's report under torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Rank 0 is slow to find its problem; rank 1 reports at once. Both exit 2, as a config error does.
_REPORTER = """
import os, sys, time
rank = int(os.environ["RANK"])
if rank == 0:
    time.sleep(3)
print(f"problem seen by rank {rank}", file=sys.stderr, flush=True)
if os.environ.get("WAIT_FOR_PEERS") == "1":
    from torchtitan.distributed.lifecycle import wait_for_peer_reports
    print(f"rank {rank} heard every peer: {wait_for_peer_reports('test', 30)}", file=sys.stderr, flush=True)
sys.exit(2)
"""


@pytest.mark.parametrize("wait", [False, True], ids=["no_wait", "wait"])
def test_every_rank_reports_before_torchrun_stops_the_job(tmp_path, wait):
    script = tmp_path / "reporter.py"
    script.write_text(_REPORTER)
    env = {**os.environ, "PYTHONPATH": str(REPO), "WAIT_FOR_PEERS": "1" if wait else "0"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "--monitor-interval=0.1", str(script)],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert out.returncode != 0
    assert "problem seen by rank 1" in out.stderr, out.stderr[-2000:]
    if wait:
        assert "problem seen by rank 0" in out.stderr, out.stderr[-2000:]
        assert out.stderr.count("heard every peer: True") == 2, out.stderr[-2000:]
    else:  # the race the wait closes: torchrun stopped rank 0 while it was still sleeping
        assert "problem seen by rank 0" not in out.stderr, out.stderr[-2000:]
