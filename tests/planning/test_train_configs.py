"""A dry run of each shipped train_configs/*.toml at its intended world size (8B at 8, 70B at 256, 405B at
512 with PP), and the layout search at 4 ranks, whose best layout then trains for real through torchrun.

These are the planner's heaviest tests (and one cheap one that pins the 8B FSDP 8 prediction). The 8B and
70B jobs are simulated with 3 and 4 blocks and counted (planning/symmetry.py; about 2 and 4 s of CPU), and
405B's first pipeline rank (embedding, the most micro-batches in flight; about 20 s): every simulation in one
pool. The last pipeline rank cost as much again and is covered at small sizes by test_symmetry.py. Timings
in benchmarks/history.md section 17 (the planner's speed). Every shipped MoE config gets the fast preflight
at its world size; GPT-OSS 20b and 120b and DeepSeek-V3 16B are dry-run too (one pool). DeepSeek-V3 671B and
Kimi K2 (PP 16) are not: each dry run takes many minutes here (benchmarks/README.md section 28)."""

from __future__ import annotations

import pytest
from conftest import CI_CONFIG, REPO, load_script, run_torchrun

from torchtitan.config import ConfigError, ConfigManager
from torchtitan.planning.clusters import load_cluster
from torchtitan.planning.cost import estimate
from torchtitan.planning.dry_run import dry_run, dry_runs, plan_job


@pytest.mark.parametrize(("config", "world", "layout"), [
    ("llama3_8b", 8, {"dp_shard": 8}), ("llama3_70b", 256, {"dp_shard": 32, "tp": 8}),
    ("llama3_405b", 512, {"dp_shard": 8, "tp": 8, "pp": 8}), ("qwen3_30b_a3b", 64, {"dp_shard": 64, "ep": 8}),
    ("mixtral_8x7b", 64, {"dp_shard": 64, "ep": 8}), ("deepseek_v3_16b", 64, {"dp_shard": 64, "ep": 8}),
    ("deepseek_v3_671b", 2048, {"dp_shard": 128, "pp": 16, "ep": 64}),
    ("kimi_k2", 1024, {"dp_shard": 64, "pp": 16, "ep": 16}), ("gpt_oss_20b", 8, {"dp_shard": 8, "ep": 8}),
    ("gpt_oss_120b", 64, {"dp_shard": 64, "ep": 8})])
def test_shipped_configs_pass_the_preflight_at_their_world_sizes(config, world, layout):
    """The launch checks alone (no dry run, well under a second each): degrees, batch, pipeline split."""
    plan = plan_job(ConfigManager().parse_args(["--job.config_file", str(REPO / "train_configs" / f"{config}.toml")]),
                    world)
    assert {dim: plan.dims.degree(dim) for dim in layout} == layout


@pytest.mark.slow  # the dry run forks: two simulations of 3 and 4 blocks, about 2 s of CPU
def test_8b_fsdp8_row_stays_in_its_band_against_the_published_run():
    """benchmarks/plan_validation.py's 8b-fsdp8 row: TorchTitan's Llama 3 8B on 8 H100s (FSDP 8, 8k tokens).

    The targets (docs/planning.md) are tokens/s within 20% and memory within 15% of the published run;
    the prediction is deterministic, so it is also pinned to the figures benchmarks/README.md section 17
    gives for it (6,622 tokens/s per GPU, 77.7 GiB), to a rounding.
    """
    cluster, world, args, pp_ranks, published_tps, _, published_gib = load_script(
        "benchmarks/plan_validation.py").ROWS["8b-fsdp8"]
    e = estimate(dry_run(ConfigManager().parse_args(args), world, pp_ranks=pp_ranks), load_cluster(cluster))
    assert abs(e.tokens_per_second_per_gpu / published_tps - 1) <= 0.20, e.tokens_per_second_per_gpu
    assert abs(e.peak_memory_gib / published_gib - 1) <= 0.15, e.peak_memory_gib
    assert e.tokens_per_second_per_gpu == pytest.approx(6622, abs=0.5)
    assert e.peak_memory_gib == pytest.approx(77.7, abs=0.05)


@pytest.mark.slow  # the dry runs fork: three simulations in one pool, about 35 s of CPU (benchmarks §28)
def test_moe_configs_dry_run_and_fit_at_their_world_sizes():
    """GPT-OSS 20b on 8 H100s and 120b on 64 (FSDP, EP 8): their blocks counted in pairs (a sliding layer's attention
    does less work than a full one's), the sink attention priced as FlexAttention. DeepSeek-V3 16B on 64
    (FSDP 64, EP 8): every block simulated (the first is dense), MLA priced. Each fits in 80 GiB and holds more
    than its parameters and optimizer state."""
    jobs = [("gpt_oss_20b", 8), ("gpt_oss_120b", 64), ("deepseek_v3_16b", 64)]
    runs = dry_runs([(ConfigManager().parse_args(["--job.config_file", str(REPO / "train_configs" / f"{c}.toml")]),
                      world, None) for c, world in jobs])
    cluster = load_cluster("h100-sxm-80g")
    for run, (config, _) in zip(runs, jobs, strict=True):
        e = estimate(run, cluster)
        (rank,) = run.ranks
        state = rank.memory.final["parameters"] + rank.memory.final["optimizer"]
        assert 30 < e.peak_memory_gib < 80 and rank.memory.peak_bytes > state, (config, e.peak_memory_gib)
        assert e.tokens_per_second_per_gpu > 0, config


@pytest.mark.slow
def test_shipped_configs_dry_run_at_their_world_sizes():
    """8B at 8, 70B at 256 (their blocks counted), 405B at 512 (its first pipeline rank), in one pool."""
    jobs = [("llama3_8b.toml", 8, None), ("llama3_70b.toml", 256, None), ("llama3_405b.toml", 512, [0])]
    cfgs = [ConfigManager().parse_args(["--job.config_file", str(REPO / "train_configs" / c)]) for c, _, _ in jobs]
    runs = dry_runs([(cfg, world, pp_ranks) for cfg, (_, world, pp_ranks) in zip(cfgs, jobs, strict=True)])
    for run, (config, _, pp_ranks) in zip(runs, jobs, strict=True):
        assert len(run.ranks) == (len(pp_ranks) if pp_ranks else 1), config
        for r in run.ranks:
            m = r.memory
            assert m.peak_bytes > m.final["parameters"] + m.final["optimizer"] > 0, config
            assert m.at_peak["activations"] + m.at_peak["in_flight"] + m.at_peak["backward"] > 0, config
            assert r.work["backward"].matmul_flops > r.work["forward"].matmul_flops > 0, config
    for run in runs[:2]:
        assert any(note.startswith("blocks counted") for note in run.notes), run.notes
    (first,) = runs[2].ranks
    assert first.stages == [0, 8]
    assert first.traffic.by_dim()["pp"] > 0


@pytest.mark.slow
def test_search_returns_accepted_layouts_and_the_best_trains(tmp_path):
    from torchtitan.planning.clusters import load_cluster
    from torchtitan.planning.search import search

    args = ["--job.config_file", CI_CONFIG, "--training.batch_size=1"]
    layouts = search(args, 4, load_cluster("h100-sxm-80g"))
    assert layouts
    speeds = [layout.estimate.tokens_per_second_per_gpu for layout in layouts]
    assert speeds == sorted(speeds, reverse=True)
    for layout in layouts:
        try:
            plan_job(ConfigManager().parse_args([*args, *layout.overrides]), 4)
        except ConfigError as e:  # pragma: no cover - the assertion names the layout
            pytest.fail(f"search returned a layout the preflight refuses: {layout.overrides}: {e}")
    best = layouts[0].overrides
    out = run_torchrun(REPO / "train.py", *args, *best, "--training.steps=2", "--lr_scheduler.warmup_steps=0",
                       f"--job.dump_folder={tmp_path}", "--metrics.enable_tensorboard=false", nproc=4, timeout=900,
                       env={"OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Training done: 2 steps" in out.stderr + out.stdout
