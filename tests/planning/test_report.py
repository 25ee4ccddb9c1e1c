"""The dry run's readable report (planning/report.py): each simulated rank's figures under its own name."""

from __future__ import annotations

import re

from conftest import debug_config

from torchtitan.planning.clusters import load_cluster
from torchtitan.planning.compute import PhaseWork
from torchtitan.planning.cost import estimate
from torchtitan.planning.dry_run import DryRun, RankRun, plan_job
from torchtitan.planning.memory import GIB, MemoryReport
from torchtitan.planning.report import dry_run_text, estimate_text
from torchtitan.planning.traffic import CollectiveStats, TrafficLedger

EP_FORWARD = ("ep", "all_to_all", "forward", "functional")


def _rank(rank: int, stage: int, peak_gib: int, ep_forward_calls: int) -> RankRun:
    traffic = TrafficLedger({})
    traffic.stats[EP_FORWARD] = CollectiveStats(ep_forward_calls, ep_forward_calls * 2**20)
    traffic.group_ranks["ep"] = [0, 1]
    memory = MemoryReport(peak_bytes=peak_gib * GIB, at_peak={"activations": peak_gib * GIB}, final={},
                          peak_phase="forward")
    work = {phase: PhaseWork(matmul_flops=10**12) for phase in ("forward", "backward")}
    return RankRun(rank, {"pp": stage}, [stage], memory, traffic, work, seconds=1.0)


def _pipelined(*ranks: RankRun) -> DryRun:
    cfg = debug_config("--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_microbatches=2",
                       "--training.batch_size=2")
    return DryRun(cfg, 2, plan_job(cfg, 2), steps=1, ranks=list(ranks))


def test_each_simulated_ranks_collectives_are_printed_under_its_own_name():
    # DeepSeek-V3 671B at PP 16 under selective AC 'moe': stage 0 holds three dense blocks and one MoE block, stage 1
    # four MoE blocks and the higher peak. The report printed only the highest peak's collectives, and stage 1's
    # 960 forward all-to-alls were read as stage 0's (benchmarks/README.md §36, against its 240 under full AC).
    text = dry_run_text(_pipelined(_rank(0, 0, 1, 240), _rank(1, 1, 2, 960)))
    tables = re.findall(r"^collectives per step of (rank \d+ \(pipeline stages \[\d\]\)).*?\n(.*?)(?=^\S|\Z)", text,
                        re.M | re.S)
    ep_forward = {name: int(re.search(r"^ +ep +all_to_all +forward +(\d+)", rows, re.M).group(1))
                  for name, rows in tables}
    assert ep_forward == {"rank 0 (pipeline stages [0])": 240, "rank 1 (pipeline stages [1])": 960}, text


def test_the_estimate_names_the_rank_of_its_peak_and_the_rank_of_its_step():
    # Stage 0 has the higher peak, stage 1 the longer step (four times the all-to-alls): the memory line is stage
    # 0's, the step and its communication per step are stage 1's.
    run = _pipelined(_rank(0, 0, 3, 240), _rank(1, 1, 2, 960))
    e = estimate(run, load_cluster("h100-sxm-80g"))
    assert (e.worst_rank, e.slowest_rank) == (0, 1)
    assert e.comm_bytes_per_step == run.ranks[1].traffic.by_dim()
    text = estimate_text(e, "h100-sxm-80g")
    assert "GiB on rank 0 (" in text and " s on rank 1 = compute" in text
    assert "communication per step of rank 1:" in text
