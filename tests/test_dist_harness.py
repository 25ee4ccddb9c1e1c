"""The forked-rank harness (tests/dist_harness.py): what reaches the ranks, and how a rank's death is reported."""

from __future__ import annotations

import os
import sys

import pytest
from dist_harness import run_ranks

pytestmark = pytest.mark.slow


def _abort_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        print("rank 1 is about to abort", file=sys.stderr, flush=True)
        os.abort()  # what a C++ std::terminate does to a rank: SIGABRT, no Python traceback
    return rank


def test_a_rank_killed_by_a_signal_fails_the_call_at_once_with_the_end_of_its_output(tmp_path):
    # Without the check for dead ranks the call waits out the whole timeout and says only "timed out".
    with pytest.raises(AssertionError) as failure:
        run_ranks(_abort_on_rank_1, 2, timeout=600, log_dir=str(tmp_path))
    message = str(failure.value)
    assert "rank 1 died without answering: killed by SIGABRT" in message
    assert "rank 1 is about to abort" in message  # its log's end, written through the redirected stderr
    # and the Python stack where it died, which a native crash's log otherwise lacks (faulthandler)
    assert "Fatal Python error: Aborted" in message and "in _abort_on_rank_1" in message
    assert "timed out" not in message


def _settings(rank: int, world_size: int) -> tuple[str, int, int]:
    import torch
    import torch._inductor.config as inductor_config

    return os.environ["HARNESS_PROBE"], torch.get_num_threads(), inductor_config.compile_threads


def test_env_reaches_the_ranks_and_the_settings_torch_read_at_import(tmp_path):
    # 3 threads and 1 compile worker: neither is what the forkserver's own import of torch set on this machine.
    env = {"HARNESS_PROBE": "yes", "OMP_NUM_THREADS": "3", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    assert run_ranks(_settings, 1, env=env, log_dir=str(tmp_path)) == [("yes", 3, 1)]
