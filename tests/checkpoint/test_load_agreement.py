"""A checkpoint load that fails on one rank fails on every rank, with that rank's message, at once.

Two faults are injected on rank 1 only, after the checkpoint was written (and so after
the preflight that validated it): its choice of checkpoint fails (as if the manifest
changed under it), and its own data file is truncated (DCP's read fails there). Without
agreement, rank 1 would raise while rank 0 waits in the next collective until the
checkpoint group's timeout (30 minutes).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch.distributed as dist
from checkpoint.helpers import FSDP2, make_trainer
from dist_harness import run_ranks

pytestmark = pytest.mark.slow  # every test here starts processes

INJECTED = "injected: this rank's manifest is unreadable"


def _load_outcome(trainer) -> tuple[str, float]:
    start = time.monotonic()
    try:
        trainer.checkpointer.load()
    except RuntimeError as e:
        return str(e), time.monotonic() - start
    return "loaded", time.monotonic() - start


def _faulty_loads(rank: int, world_size: int, dump: str) -> dict:
    import torchtitan.checkpoint.loader as loader

    # Short training timeout: the loads below must not need it, they must fail at once.
    # Without checksums: a truncated file must fail DCP's own read here (with them, the damaged
    # checkpoint is caught before reading, which tests/checkpoint/test_integrity.py covers).
    common = [*FSDP2, "--checkpoint.interval=2", "--comm.train_timeout_seconds=30", "--checkpoint.checksums=false"]
    make_trainer(dump, *common, "--training.steps=2").train()  # writes step-2
    out = {}

    # 1. Rank 1 cannot choose the checkpoint.
    trainer = make_trainer(dump, *common, "--training.steps=4")
    if rank == 1:
        real = loader.choose_checkpoint
        loader.choose_checkpoint = lambda *_: (None, {}, [INJECTED])
    out["choose"] = _load_outcome(trainer)
    if rank == 1:
        loader.choose_checkpoint = real

    # 2. Rank 1's own data file is cut short (DCP names each rank's file __<rank>_0.distcp) after
    #    the preflight, which would have refused it, and before the load.
    trainer = make_trainer(dump, *common, "--training.steps=4")
    dist.barrier()
    if rank == 1:
        data = Path(dump) / "checkpoint" / "step-2" / "__1_0.distcp"
        data.write_bytes(data.read_bytes()[:100])
    dist.barrier()
    out["read"] = _load_outcome(trainer)
    return out


def test_a_load_failing_on_one_rank_fails_every_rank_with_its_message(tmp_path):
    outcomes = run_ranks(_faulty_loads, 2, str(tmp_path), timeout=240)
    for rank, out in enumerate(outcomes):
        message, seconds = out["choose"]
        assert "rank 1: " in message and INJECTED in message, (rank, message)
        assert "rank 0: " not in message, (rank, message)  # rank 0 had nothing to report
        assert seconds < 20, (rank, seconds)
        message, seconds = out["read"]
        assert "failed on" in message and "rank 1: " in message, (rank, message)
        assert seconds < 20, (rank, seconds)
    # Every rank raised the same error.
    assert outcomes[0]["choose"][0] == outcomes[1]["choose"][0]
