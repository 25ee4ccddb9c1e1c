"""The training timeout on every process group: a collective hung on a mesh sub-group fails within the timeout, and
the failure's log names the group (docs/launching.md, "How a run ends").

Four gloo ranks in a dp_shard 2 x tp 2 layout. After the trainer's ``set_collective_timeout``, rank 1 skips two
collectives: its TP peer (rank 0) waits for it on ``tp`` and its dp_shard peer (rank 3) on ``dp_shard``, both
sub-groups of the world.
"""

from __future__ import annotations

import io
import logging
import time
import warnings
from datetime import timedelta

import pytest
import torch
from dist_harness import run_ranks

pytestmark = pytest.mark.slow  # starts a gloo world

TIMEOUT_S = 2
# Rank -> the axis whose collective it waits in for rank 1 (which skips both); rank 2 waits for nobody.
HUNG_ON = {0: "tp", 3: "dp_shard"}


def _hang_on_a_sub_group(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from torchtitan.compat import default_store
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.lifecycle import set_collective_timeout
    from torchtitan.logging_setup import init_logger

    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, world_size=world_size)
    dims.build_mesh("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch only warns where it sets no timeout
        set_collective_timeout(TIMEOUT_S)
    store = default_store()
    if rank not in HUNG_ON:
        store.wait([f"hung/{r}" for r in HUNG_ON], timedelta(seconds=60))  # the peers' collectives have failed
        return {}
    log = io.StringIO()
    init_logger(rank)
    logging.getLogger().handlers[0].setStream(log)  # the trainer's log format, into a string
    group = dims.get_mesh(HUNG_ON[rank]).get_group()
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4), group=group)
    except RuntimeError:
        waited = time.monotonic() - start
        logging.getLogger("train").exception("Training failed")  # as train.py reports a failure
        return {"waited": waited, "log": log.getvalue(), "ranks": dist.get_process_group_ranks(group)}
    finally:
        store.set(f"hung/{rank}", "1")
    raise AssertionError(f"an all-reduce on {HUNG_ON[rank]} that rank 1 never joined returned")


def test_a_collective_hung_on_a_sub_group_fails_within_the_timeout_naming_the_group():
    results = run_ranks(_hang_on_a_sub_group, 4, timeout=60)
    for rank, axis in HUNG_ON.items():
        got = results[rank]
        # Not the default group's timeout (the harness's 60 s): the sub-group's own, set after the first step.
        assert TIMEOUT_S * 0.9 <= got["waited"] < TIMEOUT_S + 10, (rank, got["waited"])
        log = got["log"]
        assert "Training failed" in log and "Timed out" in log, log
        # The group the rank hung on leads the groups' last collectives: its name, its ranks and its timeout.
        listed = log.split("The last collective on each process group, newest first")[1].splitlines()[1]
        assert f"gloo:all_reduce on mesh_{axis} " in listed and f"ranks {got['ranks']}" in listed, log
        assert f"timeout {TIMEOUT_S} s" in listed, log
