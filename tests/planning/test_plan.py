"""The planner (torchtitan/planning, scripts/plan.py, train.py --dry_run) against hand counts, a real
trainer's tensors and the preflight's own lines."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from conftest import DEBUG_CONFIG, REPO, debug_config, torchrun_env

import torchtitan.planning.dry_run as dry_run_module
from torchtitan.planning.cli import plan_main
from torchtitan.planning.clusters import ClusterError, load_cluster
from torchtitan.planning.cost import estimate
from torchtitan.planning.dry_run import dry_run

DEBUG = DEBUG_CONFIG
ENV = torchrun_env(OMP_NUM_THREADS="1")


def _cfg(*overrides: str):
    return debug_config("--metrics.enable_tensorboard=false", *overrides)


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def fsdp2_tp2():
    return dry_run(_cfg("--parallelism.data_parallel_shard_degree=2", "--parallelism.tensor_parallel_degree=2"), 4)


@pytest.mark.slow
def test_traffic_of_fsdp2_tp2_equals_the_hand_count(fsdp2_tp2):
    from torchtitan.models import model_args
    from torchtitan.models.common.decoder import Decoder

    with torch.device("meta"):
        model = Decoder(model_args("llama3", "debugmodel"))
    # Per TP rank: linears and embeddings split 2 ways; norm weights whole (sequence parallel replicates them).
    local = {name: p.numel() // (1 if "norm" in name else 2) for name, p in model.named_parameters()}
    last = f"layers.{model.args.n_layers - 1}."
    blocks_but_last = sum(n for k, n in local.items() if k.startswith("layers.") and not k.startswith(last))
    rows = {(r["dim"], r["kind"], r["phase"]): r for r in fsdp2_tp2.ranks[0].traffic.rows()}
    # bf16 all-gathers of every unit in forward; backward re-gathers every block but the last (kept
    # gathered) and not the root (never resharded); one float32 reduce-scatter per unit in backward.
    assert rows["dp_shard", "all_gather", "forward"]["bytes"] == 2 * sum(local.values())
    assert rows["dp_shard", "all_gather", "forward"]["count"] == model.args.n_layers + 1
    assert rows["dp_shard", "all_gather", "backward"]["bytes"] == 2 * blocks_but_last
    assert rows["dp_shard", "reduce_scatter", "backward"]["bytes"] == 4 * sum(local.values())
    assert rows["dp_shard", "reduce_scatter", "backward"]["count"] == model.args.n_layers + 1
    assert rows["tp", "all_gather", "forward"]["count"] > 0  # sequence parallel gathers each region's input
    # The trainer's own step (PlainStep) ran: its token count before the forward and its loss sum after the
    # backward, one float64 all-reduce each over the ranks that see different tokens.
    for phase in ("build", "optimizer"):
        row = rows["dp_shard", "all_reduce", phase]
        assert (row["count"], row["bytes"]) == (1, 8), phase


@pytest.mark.slow
def test_memory_of_fsdp2_tp2_is_its_local_shards(fsdp2_tp2):
    params = _meta_params()
    # float32 master shards: linears and embeddings over all 4 ranks, norm weights over the 2 FSDP ranks.
    shards = sum(4 * p.numel() // (2 if name.endswith("norm.weight") else 4) for name, p in params)
    final = fsdp2_tp2.ranks[0].memory.final
    assert final["parameters"] == shards
    # AdamW: two float32 moments per element and one float32 step counter per parameter.
    assert final["optimizer"] == 2 * shards + 4 * len(params)
    peak = fsdp2_tp2.ranks[0].memory
    assert peak.peak_bytes == sum(peak.at_peak.values()) > final["parameters"] + final["optimizer"]


def _meta_params():
    from torchtitan.models import model_args
    from torchtitan.models.common.decoder import Decoder

    with torch.device("meta"):
        return list(Decoder(model_args("llama3", "debugmodel")).named_parameters())


@pytest.mark.slow
def test_state_agrees_with_a_real_trainers_tensors(tmp_path, monkeypatch):
    """The dry run's parameter and optimizer bytes equal what the real Trainer holds (rank 0 of a fake world)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from common import state_bytes
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torchtitan.trainer import Trainer

    overrides = ["--parallelism.data_parallel_shard_degree=3", f"--job.dump_folder={tmp_path}",
                 "--training.steps=1", "--lr_scheduler.warmup_steps=0", "--job.print_args=false"]
    run = dry_run(_cfg(*overrides), 3)  # uneven: FSDP pads each shard to the largest
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "3"}.items():
        monkeypatch.setenv(key, value)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=3)
    try:
        trainer = Trainer(_cfg(*overrides))
        held = {}
        trainer.optimizer.register_step_pre_hook(
            lambda *_: held.update(state_bytes(trainer.model_parts, trainer.optimizer)))
        trainer.train()
        held["optimizer"] = state_bytes(trainer.model_parts, trainer.optimizer)["optimizer"]
    finally:
        dist.destroy_process_group()
    final = run.ranks[0].memory.final
    assert final["parameters"] == held["params"]
    assert final["optimizer"] == held["optimizer"]


@pytest.mark.slow
def test_cost_model_orders_and_units(fsdp2_tp2):
    fast, slow = load_cluster("h100-sxm-80g"), load_cluster("a100-80g")
    a, b = estimate(fsdp2_tp2, fast), estimate(fsdp2_tp2, slow)
    assert a.step_time_s < b.step_time_s and a.fits
    # Compute by hand from the rank's kernels: each phase of the step (not the build) at the cluster's rates.
    work = [w for phase, w in fsdp2_tp2.ranks[0].work.items() if phase != "build"]
    peak = fast.peak_bf16_flops
    by_hand = sum(w.matmul_flops / (peak * fast.matmul_efficiency)
                  + (w.attention_flops - w.causal_attention_flops / 2) / (peak * fast.attention_efficiency)
                  + w.memory_bytes / (fast.hbm_bandwidth * fast.hbm_efficiency) + w.kernels * fast.kernel_launch_s
                  for w in work)
    assert a.compute_s == pytest.approx(by_hand, rel=1e-9)
    # No pipeline, no bubble. TP's collectives sit on the critical path in full; FSDP's all-gathers and
    # reduce-scatters hide behind the blocks' compute but for the first and last of each phase.
    assert a.bubble_s == 0.0
    tp, fsdp = a.comm_s_by_dim["tp"], a.comm_s_by_dim["dp_shard"]
    assert tp < a.exposed_comm_s < tp + fsdp
    assert 0 < a.mfu < 1 and set(a.comm_bytes_per_step) >= {"dp_shard", "tp"}


@pytest.mark.slow
def test_bad_config_fails_with_the_launchs_lines():
    bad = ["--job.config_file", DEBUG, "--parallelism.tensor_parallel_degree=3"]
    launch = subprocess.run([sys.executable, "train.py", "--preflight_only", *bad], cwd=REPO,
                            env={**ENV, "WORLD_SIZE": "8"}, capture_output=True, text=True, timeout=300)
    planned = _run("train.py", "--dry_run", "--world_size", "8", *bad)
    assert launch.returncode == planned.returncode == 2
    assert planned.stderr.strip() and planned.stderr == launch.stderr


@pytest.mark.slow
def test_plan_json_and_bad_inputs(tmp_path):
    out = _run("scripts/plan.py", "--cluster", "h100-sxm-80g", "--world_size", "2", "--json",
               "--job.config_file", DEBUG)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert {"fits", "peak_memory_gib", "step_time_s", "tokens_per_second_per_gpu", "mfu", "compute_s",
            "exposed_comm_s", "bubble_s", "comm_bytes_per_step"} <= set(result)
    # While it simulates, it says so on stderr: what, and how many of how many (stdout stays one JSON object)
    progress = [line.split("]: ", 1)[1] for line in out.stderr.splitlines() if line.startswith("plan [")]
    assert len(progress) == 3, out.stderr
    assert progress[:2] == ["simulating 1 rank step(s) on fake tensors, 1 at a time; the longest first",
                            "[1/1] rank 0, 6 blocks, 1 micro-batch(es): started"], out.stderr
    assert progress[2].startswith("done 1 of 1: rank 0, 6 blocks, 1 micro-batch(es) ("), out.stderr
    unknown = _run("scripts/plan.py", "--cluster", "tpu-v9", "--world_size", "2", "--job.config_file", DEBUG)
    assert unknown.returncode == 2 and "h100-sxm-80g" in unknown.stderr and "b200" in unknown.stderr
    partial = tmp_path / "mine.toml"
    partial.write_text("[device]\npeak_bf16_flops = 1e15\n")
    with pytest.raises(ClusterError, match="hbm_gib is missing"):
        load_cluster(str(partial))
    odd = _run("scripts/plan.py", "--cluster", "h100-sxm-80g", "--world_size", "6", "--job.config_file", DEBUG,
               "--parallelism.tensor_parallel_degree=4")
    assert odd.returncode == 2 and "world_size" in odd.stderr


def test_plan_help_prints_usage_and_exits_0(capsys):
    # --help wins over the required options that are missing, and over any others given
    for argv in (["--help"], ["--cluster", "h100-sxm-80g", "-h", "--job.config_file", DEBUG]):
        assert plan_main(argv) == 0
        out = capsys.readouterr().out
        assert out.startswith("usage: scripts/plan.py --world_size WORLD_SIZE") and "--search_float8" in out
        assert "python train.py --help" in out


def test_a_simulations_error_reaches_the_caller_with_its_cause(monkeypatch):
    # A torch error may hold what does not pickle (a DataDependentOutputException holds its op); the pool that
    # sends it back would report only that it could not, and lose the cause.
    class Unpicklable(Exception):
        def __reduce__(self):
            raise TypeError("not picklable")

    def fails(*args):
        raise Unpicklable("aten._local_scalar_dense.default")

    monkeypatch.setattr(dry_run_module, "simulate_rank", fails)
    with pytest.raises(RuntimeError) as raised:
        dry_run_module._simulate_numbered((0, "[1/1] rank 0", None, ()))
    message = str(pickle.loads(pickle.dumps(raised.value)))
    assert "[1/1] rank 0: Unpicklable: aten._local_scalar_dense.default" in message


@pytest.mark.slow
def test_a_layout_that_does_not_fit_names_its_largest_consumer(fsdp2_tp2):
    tiny = load_cluster("h100-sxm-80g")
    import dataclasses

    e = estimate(fsdp2_tp2, dataclasses.replace(tiny, hbm_gib=0.001))
    assert not e.fits and e.largest_consumer.split()[0] in fsdp2_tp2.worst.memory.at_peak


@pytest.mark.slow  # the dry run forks its simulation: about 3 s
def test_the_last_pipeline_stage_keeps_no_other_micro_batchs_logits():
    """1F1B runs each micro-batch's backward right after its forward on the last stage, so what it holds of other
    micro-batches is small: not their logits, which a schedule keeps to return merged unless told not to (the
    trainer reads only the losses; DeepSeek-V3 671B's last stage held 23 GiB of them)."""
    pp = "--parallelism.pipeline_parallel_"
    cfg = _cfg("--training.seq_len=32", f"{pp}degree=2", f"{pp}schedule=1F1B", f"{pp}microbatches=6",
               "--training.batch_size=6", "--parallelism.data_parallel_shard_degree=1")
    last = dry_run(cfg, 2, pp_ranks=[1], symmetry=False).ranks[0]
    one_microbatch_logits = 32 * 2048 * 2  # tokens x vocabulary x bf16, one sequence a micro-batch
    assert last.memory.at_peak["in_flight"] < one_microbatch_logits, last.memory.at_peak
