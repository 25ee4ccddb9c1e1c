"""The planner on DeepSeek-V3 with multi-token prediction under PP: the last stage returns one logits tensor
per depth beside the main one (its stated shapes say so), and the step sums the embedding's gradient over the
first and last stage (both hold it: distributed/stage_copies.py), which the traffic ledger counts."""

from __future__ import annotations

import pytest
from conftest import REPO, debug_config

from torchtitan.planning.dry_run import dry_run

VOCAB, DIM, DP = 2048, 256, 2  # the debug model's embedding, sharded over FSDP 2
FP32 = 4


@pytest.mark.slow  # the dry run simulates the ranks in a pool of processes
def test_mtp_under_pp_plans_and_counts_the_embedding_gradient_sum():
    cfg = debug_config("--metrics.enable_tensorboard=false", "--model.mtp_layers=1",
                       "--parallelism.pipeline_parallel_degree=2", "--parallelism.data_parallel_shard_degree=2",
                       "--training.batch_size=2", "--parallelism.pipeline_parallel_microbatches=2",
                       config=str(REPO / "train_configs" / "deepseek_v3_debug.toml"))
    run = dry_run(cfg, 4)
    assert [r.stages for r in run.ranks] == [[0], [1]]
    for rank in run.ranks:
        pp = [row for row in rank.traffic.rows() if row["dim"] == "pp" and row["kind"] == "all_reduce"
              and row["phase"] != "optimizer"]  # the optimizer's: the gradient norm's scalar
        # this rank's shard of the embedding's gradient (float32), beside the step's 8-byte loss sum
        assert sum(row["bytes"] for row in pp) == VOCAB * DIM * FP32 // DP + 8, pp
