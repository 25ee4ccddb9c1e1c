"""distributed/parallelize.py: the float32 linear layers move to oneDNN on a CPU unless the schedule cannot
train them; the two-hop dispatch's option without expert parallelism is said to do nothing."""

from __future__ import annotations

import pytest
from torch import nn

from torchtitan.config import ConfigManager
from torchtitan.distributed import parallelize
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.ops.cpu_kernels import OneDNNLinear, onednn_available


@pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN linear")
@pytest.mark.parametrize("schedule, takes_custom_functions, moved", [
    ("ZBVZeroBubble", False, False),  # torch 2.11: the weight pass cannot start from oneDNN's node
    ("ZBVZeroBubble", True, True),
    ("Interleaved1F1B", False, True),  # a whole backward at once: nothing to split
])
def test_onednn_linears_stay_out_of_a_split_backward_that_cannot_take_them(schedule, takes_custom_functions, moved,
                                                                         monkeypatch, caplog):
    monkeypatch.setattr(parallelize, "split_backward_takes_custom_functions", lambda: takes_custom_functions)
    cfg = ConfigManager().parse_args(["--training.cpu_matmul=onednn", "--parallelism.pipeline_parallel_degree=2",
                                      f"--parallelism.pipeline_parallel_schedule={schedule}"])
    model = nn.Sequential(nn.Linear(4, 4))
    parallelize._onednn_linears(model, ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=2, world_size=2), cfg)
    assert isinstance(model[0], OneDNNLinear) == moved
    assert ("cannot take a weight gradient through oneDNN's linear" in caplog.text) == (not moved)


def test_two_hop_option_without_expert_parallelism_is_said_to_do_nothing(caplog):
    parallelize.warn_unused_dispatch_option(ConfigManager().parse_args([]))
    assert "dispatch_gpus_per_node" not in caplog.text
    parallelize.warn_unused_dispatch_option(ConfigManager().parse_args(["--moe.dispatch_gpus_per_node=8"]))
    assert "--moe.dispatch_gpus_per_node=8 has no effect: expert parallelism is off" in caplog.text
