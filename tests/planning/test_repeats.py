"""What a dry run counts instead of simulating (torchtitan/planning/repeats.py): identical blocks (of a stage, or
of the model without a pipeline) and identical micro-batches (the pipeline's, or gradient accumulation's). Each
counted rank equals the simulation of its whole step, figure by figure."""

from __future__ import annotations

import pytest
from conftest import REPO, debug_config

from torchtitan.planning import repeats
from torchtitan.planning.dry_run import RankRun, dry_run, plan_job
from torchtitan.planning.repeats import block_counting, blocks_to_count, microbatches_to_count

_PP = "--parallelism.pipeline_parallel_"
_SMALL = ("--metrics.enable_tensorboard=false", "--training.seq_len=32")


def _assert_equal(counted: RankRun, every: RankRun) -> None:
    """Every figure equal, but the split of the kept forward tensors into the largest micro-batch's and the others'
    (``memory.fold``) is compared as their sum: it goes by which micro-batch's tag each was allocated under (receive
    buffers and scalars take the last forward's), which can move between the two at another step size."""
    a, b = counted.memory, every.memory
    assert (a.peak_bytes, a.peak_phase) == (b.peak_bytes, b.peak_phase)
    assert _joined(a.at_peak) == _joined(b.at_peak)
    assert _joined(a.final) == _joined(b.final)
    assert counted.work == every.work
    assert counted.traffic.rows() == every.traffic.rows()


def _joined(split: dict[str, int]) -> dict[str, int]:
    out = dict(split)
    out["activations"] = out.pop("activations", 0) + out.pop("in_flight", 0)
    return out


def test_blocks_are_counted_only_where_they_are_alike(debug_blocks):
    def counted(*overrides: str) -> tuple[int, str]:
        cfg = debug_config(f"--model.flavor={debug_blocks(10)}", "--parallelism.data_parallel_shard_degree=2",
                           *overrides)
        return blocks_to_count(plan_job(cfg, 2), cfg.activation_checkpoint, cfg.optimizer.name)

    assert counted("--activation_checkpoint.mode=full")[0] == 7  # simulated with 3 and 4 of the 10
    # Muon's owners are balanced over every matrix of the job: a block more moves a rank's share unevenly.
    for muon in ("Muon", "MuonClip"):  # MuonClip is Muon, then QK-clip
        fewer, why = counted("--activation_checkpoint.mode=full", f"--optimizer.name={muon}")
        assert fewer == 0 and "Muon" in why
    fewer, why = counted("--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_ac_option=2")
    assert fewer == 0 and "every 2 blocks" in why
    for per_op in ("op", "moe"):  # every block alike: each keeps and recomputes the same ops
        option = f"--activation_checkpoint.selective_ac_option={per_op}"
        assert counted("--activation_checkpoint.mode=selective", option)[0] == 7
    # Under a pipeline, each stage's blocks: 10 over 2 stages leaves 5 a stage, too few to be worth counting.
    assert counted(f"{_PP}degree=2", "--parallelism.data_parallel_shard_degree=1", "--training.batch_size=2")[0] == 0
    assert blocks_to_count(plan_job(debug_config(), 1), debug_config().activation_checkpoint)[0] == 0
    # GPT-OSS's windowed and full blocks hold the same modules but not the same attention work: counted in pairs.
    gpt_oss = debug_config(config=str(REPO / "train_configs" / "gpt_oss_20b.toml"))
    assert block_counting(plan_job(gpt_oss, 8), gpt_oss.activation_checkpoint, gpt_oss.optimizer.name)[:2] == (20, 2)


def test_microbatches_are_counted_from_where_each_schedule_repeats(debug_blocks):
    def counted(*overrides: str, world: int = 2):
        cfg = debug_config(f"--model.flavor={debug_blocks(8)}", *overrides)
        return microbatches_to_count(plan_job(cfg, world))[:2]

    pp2 = (f"{_PP}degree=2", "--parallelism.data_parallel_shard_degree=1")
    assert counted(*pp2, f"{_PP}schedule=1F1B", f"{_PP}microbatches=8", "--training.batch_size=8") == ((3, 4), 8)
    assert counted(*pp2, f"{_PP}schedule=1F1B", f"{_PP}microbatches=6", "--training.batch_size=6") == (None, 6)
    interleaved = (*pp2, f"{_PP}schedule=Interleaved1F1B", f"{_PP}stages_per_rank=2")
    assert counted(*interleaved, f"{_PP}microbatches=14", "--training.batch_size=14") == ((6, 8), 14)
    assert counted(*interleaved, f"{_PP}microbatches=12", "--training.batch_size=12") == (None, 12)
    zero_bubble = (*pp2, f"{_PP}schedule=ZBVZeroBubble", "--activation_checkpoint.mode=none")
    assert counted(*zero_bubble, f"{_PP}microbatches=12", "--training.batch_size=12") == (None, 12)
    looped = (*pp2, f"{_PP}schedule=LoopedBFS", f"{_PP}stages_per_rank=2")
    assert counted(*looped, f"{_PP}microbatches=12", "--training.batch_size=12") == (None, 12)
    accumulated = ("--parallelism.data_parallel_shard_degree=2", "--training.batch_size=1")
    assert counted(*accumulated, "--training.global_batch_size=12") == ((2, 3), 6)
    assert counted(*accumulated, "--training.global_batch_size=8") == (None, 4)
    # Accumulated over a pipeline: whole schedules are counted, each with the job's micro-batches.
    pp_accumulated = (*pp2, f"{_PP}schedule=1F1B", f"{_PP}microbatches=2", "--training.batch_size=2")
    assert counted(*pp_accumulated, "--training.global_batch_size=12") == ((2, 3), 6)
    assert counted(*pp_accumulated, "--training.global_batch_size=8") == (None, 4)


@pytest.mark.slow  # six simulations (forked) of a small step, a few seconds in all
@pytest.mark.parametrize("schedule,microbatches", [("GPipe", 7), ("1F1B", 7), ("Interleaved1F1B", 14)])
def test_counted_microbatches_equal_every_microbatch_simulated(debug_blocks, schedule, microbatches):
    """PP 2 x FSDP 2, a block a stage: each simulated pp rank, with two small micro-batch counts simulated and the
    rest counted, equals its simulation with all of them."""
    v = 2 if schedule == "Interleaved1F1B" else 1
    cfg = debug_config(f"--model.flavor={debug_blocks(2 * v)}", *_SMALL, f"{_PP}degree=2", f"{_PP}schedule={schedule}",
                       f"{_PP}stages_per_rank={v}", f"{_PP}microbatches={microbatches}",
                       f"--training.batch_size={microbatches}", "--parallelism.data_parallel_shard_degree=2")
    counted, every = dry_run(cfg, 4), dry_run(cfg, 4, symmetry=False)
    assert any("pipeline micro-batches counted" in n for n in counted.notes)
    assert [r.coords["pp"] for r in counted.ranks] == [r.coords["pp"] for r in every.ranks] == [0, 1]
    for c, e in zip(counted.ranks, every.ranks, strict=True):
        _assert_equal(c, e)


@pytest.mark.slow  # four simulations of one rank and one of the whole step
def test_counted_blocks_and_microbatches_of_a_pipeline_stage(debug_blocks, monkeypatch):
    """1F1B, PP 2 x TP 2, 5 blocks a stage, 7 micro-batches, full AC: each stage simulated with 3 and 4 blocks at 3
    and 4 micro-batches, counted at 5 blocks and 7 micro-batches, equals the whole step of pp rank 0."""
    monkeypatch.setattr(repeats, "FEWEST_BLOCKS", 5)  # worth it from 8 blocks a stage; 5 keeps the test small
    cfg = debug_config(f"--model.flavor={debug_blocks(10)}", *_SMALL, f"{_PP}degree=2", f"{_PP}schedule=1F1B",
                       f"{_PP}microbatches=7", "--training.batch_size=7", "--parallelism.tensor_parallel_degree=2",
                       "--parallelism.data_parallel_shard_degree=1", "--activation_checkpoint.mode=full")
    counted, every = dry_run(cfg, 4, pp_ranks=[0]), dry_run(cfg, 4, pp_ranks=[0], symmetry=False)
    assert any("each stage simulated with 2 blocks fewer" in n for n in counted.notes)
    assert any("pipeline micro-batches counted: 3 and 4 of the 7" in n for n in counted.notes)
    _assert_equal(counted.ranks[0], every.ranks[0])


@pytest.mark.slow  # four simulations (forked) of a few blocks and one of the whole step
def test_counted_blocks_and_accumulation_equal_the_whole_step(debug_blocks, monkeypatch):
    """5 blocks under FSDP 2 x TP 2, full AC, 5 accumulated micro-batches: simulated with 3 and 4 blocks at 2 and 3
    micro-batches and counted, every figure of the rank equals the simulation of all 5 blocks and 5 micro-batches."""
    monkeypatch.setattr(repeats, "FEWEST_BLOCKS", 5)  # worth it from 8 blocks; 5 keeps the test small
    cfg = debug_config(f"--model.flavor={debug_blocks(5)}", *_SMALL,
                       "--parallelism.data_parallel_shard_degree=2", "--parallelism.tensor_parallel_degree=2",
                       "--activation_checkpoint.mode=full", "--training.batch_size=1",
                       "--training.global_batch_size=10")
    counted, every = dry_run(cfg, 4), dry_run(cfg, 4, symmetry=False)
    assert counted.plan.grad_accum == 5
    assert any("blocks counted: 3 and 4 of the 5" in n for n in counted.notes)
    assert any("accumulated micro-batches counted: 2 and 3 of the 5" in n for n in counted.notes)
    _assert_equal(counted.ranks[0], every.ranks[0])


@pytest.mark.slow  # two simulations (forked) of a small pipeline step and one of the whole step
def test_counted_accumulation_over_a_pipeline_equals_the_whole_step(debug_blocks):
    """PP 2 (1F1B, 2 micro-batches) x FSDP 2 accumulating 5 micro-steps: simulated with 2 and 3 schedules and
    counted, pp rank 0 equals the simulation of all 5 (the Kimi K2 plan accumulates 64)."""
    cfg = debug_config(f"--model.flavor={debug_blocks(2)}", *_SMALL, f"{_PP}degree=2", f"{_PP}schedule=1F1B",
                       f"{_PP}microbatches=2", "--training.batch_size=2", "--training.global_batch_size=20",
                       "--parallelism.data_parallel_shard_degree=2")
    counted, every = dry_run(cfg, 4, pp_ranks=[0]), dry_run(cfg, 4, pp_ranks=[0], symmetry=False)
    assert counted.plan.grad_accum == 5
    assert any("accumulated pipeline schedules counted: 2 and 3 of the 5" in n for n in counted.notes)
    _assert_equal(counted.ranks[0], every.ranks[0])


@pytest.mark.slow  # two simulations (forked) of 4 and 6 blocks and one of all 8
def test_counted_blocks_of_alternating_windows_equal_every_block_simulated(monkeypatch):
    """GPT-OSS's debug model at 8 blocks (windowed and full alternating, whose attention differs in work) under FSDP
    2, full AC: simulated with 4 and 6 blocks and counted in runs of 2, every figure equals all 8 simulated."""
    import dataclasses

    from torchtitan.models.gpt_oss.args import gpt_oss_flavors

    eight = dataclasses.replace(gpt_oss_flavors["debugmodel"], n_layers=8, layer_types=())  # the plan carries them
    monkeypatch.setitem(gpt_oss_flavors, "debugmodel", eight)
    cfg = debug_config(*_SMALL, "--parallelism.data_parallel_shard_degree=2", "--activation_checkpoint.mode=full",
                       config=str(REPO / "train_configs" / "gpt_oss_debug.toml"))
    counted, every = dry_run(cfg, 2), dry_run(cfg, 2, symmetry=False)
    assert any("blocks counted: 4 and 6 of the 8" in n for n in counted.notes)
    _assert_equal(counted.ranks[0], every.ranks[0])
