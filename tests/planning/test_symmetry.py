"""The dry run's symmetry (torchtitan/planning/symmetry.py): the pp ranks it simulates stand for the others
exactly, in the totals the planner reports."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import debug_config

from torchtitan.distributed.pipeline_plan import PipelinePlan
from torchtitan.planning.clusters import load_cluster
from torchtitan.planning.cost import estimate
from torchtitan.planning.dry_run import DryRun, dry_run
from torchtitan.planning.symmetry import describe, representatives

_PP = "--parallelism.pipeline_parallel_"


def _plan(n_layers: int, *overrides: str) -> PipelinePlan:
    cfg = debug_config(*overrides)
    return PipelinePlan.from_config(cfg.parallelism, cfg.training, cfg.activation_checkpoint, n_layers)


def test_even_split_simulates_first_one_middle_and_last():
    plan = _plan(126, f"{_PP}degree=16", f"{_PP}schedule=Interleaved1F1B", f"{_PP}microbatches=16",
                 "--training.batch_size=16")
    # 126 layers over 32 stages: stages 8 and 24 hold 3 layers, the others 4, so pp rank 8 has a shape of its own.
    assert representatives(plan) == {0: [0], 1: [1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14], 8: [8], 15: [15]}
    line = describe(plan)
    assert line is not None and "uneven" in line and "1 (4+4 layers; stands for 2-7, 9-14)" in line
    even = _plan(128, f"{_PP}degree=16", f"{_PP}schedule=1F1B", f"{_PP}microbatches=16", "--training.batch_size=16")
    assert representatives(even) == {0: [0], 1: list(range(1, 15)), 15: [15]}
    assert "uneven" not in (describe(even) or "")


def test_a_schedule_of_another_warm_up_simulates_every_rank():
    plan = _plan(16, f"{_PP}degree=4", f"{_PP}schedule=ZBVZeroBubble", f"{_PP}microbatches=8",
                 "--training.batch_size=8")
    assert representatives(plan) == {r: [r] for r in range(4)}
    assert "every pipeline rank simulated" in (describe(plan) or "")
    assert representatives(None) == {0: [0]} and describe(None) is None


@pytest.mark.slow  # four simulated ranks of a 16-rank world, about 15 s
def test_counted_totals_equal_every_rank_simulated(debug_blocks):
    """PP 4 (Interleaved1F1B, 2 stages of 2 layers per rank, 8 micro-batches) x TP 2 x FSDP 2: pp rank 1 stands
    for pp rank 2; simulating rank 2 as well changes no figure the planner reports."""
    cfg = debug_config(f"--model.flavor={debug_blocks(16)}", "--metrics.enable_tensorboard=false",
                       f"{_PP}degree=4", f"{_PP}schedule=Interleaved1F1B", f"{_PP}microbatches=8",
                       "--training.batch_size=8", "--parallelism.tensor_parallel_degree=2",
                       "--parallelism.data_parallel_shard_degree=2", "--activation_checkpoint.mode=full")
    counted = dry_run(cfg, 16)
    assert [r.coords["pp"] for r in counted.ranks] == [0, 1, 3]
    assert [r.stands_for for r in counted.ranks] == [[0], [1, 2], [3]]
    middle = counted.ranks[1]
    other = dry_run(cfg, 16, pp_ranks=[2]).ranks[0]
    # Same work, phase by phase, and the same collectives (count and bytes per dim, kind and phase).
    assert other.work == middle.work
    assert other.traffic.rows() == middle.traffic.rows()
    # Fewer micro-batches in flight: a lower peak, of the same state.
    assert other.memory.peak_bytes < middle.memory.peak_bytes
    assert other.memory.final == middle.memory.final
    every = dataclasses.replace(counted, ranks=[*counted.ranks[:2], other, counted.ranks[2]], notes=[])
    assert every.worst is counted.worst
    # Totals over the job's pp ranks: each simulated rank counted as many times as it stands for.
    for key in ("matmul_flops", "attention_flops", "memory_bytes", "kernels"):
        def work(r, key=key):
            return sum(getattr(w, key) for w in r.work.values())
        assert _counted(counted, work) == sum(work(r) for r in every.ranks), key
    for d in {d for r in every.ranks for d in r.traffic.by_dim()}:
        def traffic(r, d=d):
            return r.traffic.by_dim().get(d, 0)
        assert _counted(counted, traffic) == sum(traffic(r) for r in every.ranks), d
    # And the plan: the same estimate, field by field.
    cluster = load_cluster("h100-sxm-80g")
    assert estimate(counted, cluster) == estimate(every, cluster)


def _counted(run: DryRun, value) -> int:
    return sum(value(r) * len(r.stands_for) for r in run.ranks)
