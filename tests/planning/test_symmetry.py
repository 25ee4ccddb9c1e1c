"""The dry run's symmetry (torchtitan/planning/symmetry.py): the pp ranks it simulates stand for the others
exactly, in the totals the planner reports."""

from __future__ import annotations

import dataclasses
import json

import pytest
from conftest import debug_config

from torchtitan.distributed.pipeline_plan import PipelinePlan
from torchtitan.planning.clusters import load_cluster
from torchtitan.planning.cost import estimate
from torchtitan.planning.dry_run import DryRun, dry_run, plan_job
from torchtitan.planning.symmetry import blocks_to_count, describe, representatives

_PP = "--parallelism.pipeline_parallel_"


def _plan(n_layers: int, *overrides: str) -> PipelinePlan:
    return PipelinePlan.from_config(debug_config(*overrides), n_layers)


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


def _debug_shape(tmp_path_factory, n_layers: int) -> str:
    """A release folder (Meta's params.json) of the debug model's shape with ``n_layers`` blocks."""
    folder = tmp_path_factory.mktemp(f"debug{n_layers}")
    (folder / "params.json").write_text(json.dumps({"dim": 256, "n_layers": n_layers, "n_heads": 16, "n_kv_heads": 8,
                                                    "vocab_size": 2048, "multiple_of": 256, "norm_eps": 1e-5,
                                                    "rope_theta": 500000.0}))
    return str(folder)


@pytest.fixture(scope="module")
def sixteen_layers(tmp_path_factory) -> str:
    """16 blocks, so that 8 stages hold 2 each."""
    return _debug_shape(tmp_path_factory, 16)


def test_blocks_are_counted_only_where_they_are_alike(tmp_path_factory):
    ten = _debug_shape(tmp_path_factory, 10)

    def counted(*overrides: str) -> tuple[int | None, str]:
        cfg = debug_config(f"--model.flavor={ten}", "--parallelism.data_parallel_shard_degree=2", *overrides)
        return blocks_to_count(plan_job(cfg, 2), cfg)

    assert counted("--activation_checkpoint.mode=full")[0] == 10
    n, why = counted("--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_ac_option=2")
    assert n is None and "every 2 blocks" in why
    assert counted("--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_ac_option=op")[0] == 10
    # A pipeline's ranks are reduced by their stage shapes instead; the debug model's 6 blocks are too few to count.
    assert counted("--parallelism.pipeline_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1",
                   "--training.batch_size=2")[0] is None
    assert blocks_to_count(plan_job(debug_config(), 1), debug_config())[0] is None


@pytest.mark.slow  # three simulations (forked), about 5 s
def test_counted_blocks_equal_every_block_simulated(tmp_path_factory):
    """10 blocks under FSDP 2 x TP 2, full AC, two accumulated micro-batches: simulated with 3 and 4 blocks and
    counted, every figure of the rank equals the simulation of all 10."""
    cfg = debug_config(f"--model.flavor={_debug_shape(tmp_path_factory, 10)}", "--metrics.enable_tensorboard=false",
                       "--parallelism.data_parallel_shard_degree=2", "--parallelism.tensor_parallel_degree=2",
                       "--activation_checkpoint.mode=full", "--training.seq_len=128", "--training.batch_size=2",
                       "--training.global_batch_size=8")
    counted, every = dry_run(cfg, 4), dry_run(cfg, 4, symmetry=False)
    assert counted.plan.grad_accum == 2 and "blocks counted: 3 and 4 of the 10" in counted.notes[-1]
    a, b = counted.ranks[0].memory, every.ranks[0].memory
    assert (a.peak_bytes, a.at_peak, a.final, a.peak_phase) == (b.peak_bytes, b.at_peak, b.final, b.peak_phase)
    assert counted.ranks[0].work == every.ranks[0].work
    assert counted.ranks[0].traffic.rows() == every.ranks[0].traffic.rows()


@pytest.mark.slow  # four simulated ranks of a 16-rank world, about 15 s
def test_counted_totals_equal_every_rank_simulated(sixteen_layers):
    """PP 4 (Interleaved1F1B, 2 stages of 2 layers per rank, 8 micro-batches) x TP 2 x FSDP 2: pp rank 1 stands
    for pp rank 2; simulating rank 2 as well changes no figure the planner reports."""
    cfg = debug_config(f"--model.flavor={sixteen_layers}", "--metrics.enable_tensorboard=false",
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
