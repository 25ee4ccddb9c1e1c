"""End-to-end training on CPU/gloo with real processes: FSDP, HSDP, DDP and one process."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import conftest
import pytest
import torch
from conftest import DEBUG_CONFIG, REPO, run_torchrun, torchrun_env
from dist_harness import run_ranks
from torch.distributed.tensor import DTensor

from torchtitan.batch import Batch
from torchtitan.distributed.lifecycle import shutdown_distributed
from torchtitan.ops.cpu_matmul import preferred_cpu_matmul
from torchtitan.train_step.objective import TokenTerm

pytestmark = pytest.mark.slow  # every test here starts processes

DEBUG = DEBUG_CONFIG


def make_trainer(dump: str, *overrides: str):
    return conftest.make_trainer(dump, "--metrics.log_freq=100", *overrides)


# The 8-rank FSDP/HSDP/DDP training runs and their loss parity with one process live in
# tests/distributed/test_layout_parity.py, so CI trains each layout once.


def _grads_after_one_backward(rank: int, world_size: int, dump: str, overrides: list[str], n_micro: int) -> dict:
    trainer = make_trainer(dump, *overrides)
    data = iter(trainer.dataloader)
    batches = trainer.runner.prepare([Batch.of(next(data)) for _ in range(n_micro)])
    trainer.runner.forward_backward(batches, trainer.step_strategy.local_scale(batches))
    grads = {}
    for name, param in trainer.model_parts[0].named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        grads[name] = grad.clone()
    from torchtitan.distributed import clip_grad_norm_

    norm = float(clip_grad_norm_(trainer.model_parts[0].parameters(), max_norm=0.0))
    return {"grads": grads, "norm": norm} if rank == 0 else {"norm": norm}


def test_gradient_accumulation_equals_larger_batch(tmp_path):
    base = ["--parallelism.data_parallel_shard_degree=2"]
    (accum, _) = run_ranks(_grads_after_one_backward, 2, str(tmp_path), [*base, "--training.batch_size=2",
                                                                         "--training.gradient_accumulation_steps=2"], 2)
    (big, _) = run_ranks(_grads_after_one_backward, 2, str(tmp_path), [*base, "--training.batch_size=4"], 1)
    assert accum["grads"].keys() == big["grads"].keys()
    for name in big["grads"]:
        torch.testing.assert_close(accum["grads"][name], big["grads"][name], rtol=1e-5, atol=1e-7, msg=name)


def test_global_grad_norm_equals_single_process(tmp_path):
    hsdp = run_ranks(_grads_after_one_backward, 4, str(tmp_path),
                     ["--parallelism.data_parallel_replicate_degree=2", "--parallelism.data_parallel_shard_degree=2",
                      "--training.batch_size=2"], 1)
    (single,) = run_ranks(_grads_after_one_backward, 1, str(tmp_path), ["--training.batch_size=8"], 1)
    # The truth: the float64 norm of the single process's full gradients. The float32 norms differ from it
    # only by summation order (a few 1e-5 here); a missing cross-shard reduction would be off by ~sqrt(2)+.
    expected = float(torch.sqrt(sum(g.double().pow(2).sum() for g in single["grads"].values())))
    assert single["norm"] == pytest.approx(expected, rel=2e-4)
    for result in hsdp:  # every rank gets the true global norm, not its shard's
        assert result["norm"] == pytest.approx(expected, rel=2e-4)
    for name, grad in single["grads"].items():
        torch.testing.assert_close(hsdp[0]["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_single_process_cli_run_writes_config_and_tensorboard(tmp_path):
    env = torchrun_env()  # no RANK, MASTER_PORT...: a plain one-process run makes its own store
    out = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "--job.config_file", DEBUG, f"--job.dump_folder={tmp_path}",
         "--training.steps=10", "--metrics.enable_tensorboard"],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "step: 10" in out.stderr and "loss:" in out.stderr and "tps:" in out.stderr
    # training.cpu_matmul's default, auto: oneDNN where this CPU's MKL keeps to AVX2 (tests/ops/test_cpu_matmul.py)
    onednn = "43 linear layers compute float32 products on oneDNN (training.cpu_matmul=auto)" in out.stderr
    assert onednn == (preferred_cpu_matmul() == "onednn")
    assert (tmp_path / "config.toml").read_text().count("[training]") == 1
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_bad_tp_config_fails_on_every_rank_before_any_collective(tmp_path):
    out = run_torchrun(
        REPO / "train.py", "--job.config_file", DEBUG, "--parallelism.tensor_parallel_degree=2",
        "--training.seq_len=63", f"--job.dump_folder={tmp_path}",
        f"--checkpoint.initial_load_path={tmp_path / 'no_hf_folder'}", timeout=300)
    assert out.returncode != 0
    assert out.stderr.count("config error: --training.seq_len=63 must be divisible by") == 2, out.stderr[-2000:]
    # Weights to start from are checked in the same pass, on every rank.
    assert out.stderr.count(f"config error: --checkpoint.initial_load_path={tmp_path / 'no_hf_folder'}") == 2, \
        out.stderr[-2000:]
    # torchrun reports the failed workers with its own traceback; the workers raise none.
    assert f'File "{REPO / "torchtitan"}' not in out.stderr


def _losses_with(rank: int, world_size: int, dump: str, overrides: list[str]) -> list[float]:
    return make_trainer(dump, "--training.steps=3", "--training.deterministic", *overrides).train()


def test_activation_checkpointing_modes_recompute_exactly(tmp_path):
    modes = {
        "none": ["--activation_checkpoint.mode=none"],
        "full": ["--activation_checkpoint.mode=full"],
        "selective_op": ["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_ac_option=op"],
        "selective_2": ["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_ac_option=2"],
    }
    fsdp2 = ["--parallelism.data_parallel_shard_degree=2"]
    losses = {name: run_ranks(_losses_with, 2, str(tmp_path / name), [*fsdp2, *o])[0] for name, o in modes.items()}
    for name, curve in losses.items():
        # Recomputation replays the same float32 ops, so the curve is the same to the last bits.
        assert curve == pytest.approx(losses["none"], rel=1e-6), name


def test_config_error_under_torchrun_exits_on_every_rank(tmp_path):
    out = run_torchrun(
        REPO / "train.py", "--job.config_file", DEBUG, "--parallelism.data_parallel_shard_degree=3",
        f"--job.dump_folder={tmp_path}", "--activation_checkpoint.mode=selective",
        "--activation_checkpoint.selective_ac_option=every2", timeout=120)
    assert out.returncode != 0
    # One line per problem from each rank, naming the degrees and the world size, and the AC option (once
    # found only while wrapping the model, after the process group existed); nobody waits on a collective.
    assert out.stderr.count("config error: --parallelism.data_parallel_shard_degree=3 = 3, but world_size=2") == 2, \
        out.stderr[-2000:]
    assert out.stderr.count("config error: --activation_checkpoint.selective_ac_option=every2: use 'op'") == 2


def test_compiled_blocks_and_aten_products_match_eager(tmp_path):
    fsdp2 = ["--parallelism.data_parallel_shard_degree=2"]
    eager = run_ranks(_losses_with, 2, str(tmp_path / "eager"), fsdp2)[0]
    # Eager float32 linears run on oneDNN by default (ops/cpu_kernels.py); ATen's kernels differ by rounding.
    aten = run_ranks(_losses_with, 2, str(tmp_path / "aten"), [*fsdp2, "--training.cpu_matmul=aten"])[0]
    assert aten == pytest.approx(eager, rel=1e-5)
    compiled = run_ranks(_losses_with, 2, str(tmp_path / "compiled"), [*fsdp2, "--training.compile"], timeout=400)[0]
    # Inductor may fuse and reorder float32 ops, so equal to rounding, not bitwise.
    assert compiled == pytest.approx(eager, rel=1e-4)
    # AC inside a compiled block (selective op policy, the usual GPU set-up) traces too.
    sac = ["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_ac_option=op"]
    compiled_sac = run_ranks(_losses_with, 2, str(tmp_path / "sac"), [*fsdp2, "--training.compile", *sac],
                             timeout=400)[0]
    assert compiled_sac == pytest.approx(eager, rel=1e-4)


def test_profiling_writes_a_trace_per_rank(tmp_path):
    run_ranks(_losses_with, 2, str(tmp_path), ["--parallelism.data_parallel_shard_degree=2",
                                               "--profiling.enable_profiling", "--profiling.profile_freq=2"])
    traces = sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "profile_traces").glob("*/*.json"))
    # Steps 1-2 form one cycle (warm-up, record); the profiler also flushes the partial cycle at exit.
    assert {"profile_traces/iteration_2/rank0_trace.json", "profile_traces/iteration_2/rank1_trace.json"} <= set(traces)
    assert all(t.endswith(("rank0_trace.json", "rank1_trace.json")) for t in traces)
    assert '"traceEvents"' in (tmp_path / traces[0]).read_text()[:10000]


def _train_with_nan_weight(rank: int, world_size: int, dump: str) -> str:
    trainer = make_trainer(dump, "--training.steps=3", "--parallelism.data_parallel_shard_degree=2")
    weight = trainer.model_parts[0].output.weight
    with torch.no_grad():
        (weight.to_local() if isinstance(weight, DTensor) else weight).fill_(float("nan"))
    try:
        trainer.train()
    except FloatingPointError as e:
        return str(e)
    return "kept training"


def test_non_finite_loss_stops_every_rank_with_a_clear_message(tmp_path):
    messages = run_ranks(_train_with_nan_weight, 2, str(tmp_path))
    assert all(m.startswith("loss is nan at step 1") and "--optimizer.lr" in m for m in messages), messages


def _one_rank_goes_silent(rank: int, world_size: int, dump: str) -> tuple[str, float]:
    import time

    trainer = make_trainer(dump, "--training.steps=4", "--parallelism.data_parallel_shard_degree=2",
                           "--comm.train_timeout_seconds=5")
    rank0_done = Path(dump) / "rank0_done"
    if rank == 1:
        trainer.cfg.training.steps = 1  # take step 1 (which applies the training timeout), then stop answering
        trainer.train()
        deadline = time.monotonic() + 45  # silent until rank 0 has its outcome (or far past its timeout)
        while not rank0_done.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        return "silent", 0.0
    start = time.monotonic()
    try:
        trainer.train()
        outcome = "finished"
    except Exception as e:  # noqa: BLE001 - the type depends on the backend; raising at all is the point
        outcome = type(e).__name__
    seconds = time.monotonic() - start
    rank0_done.touch()
    return outcome, seconds


def test_a_silent_rank_makes_the_others_fail_after_the_train_timeout(tmp_path):
    # The harness sets up the group with a 60 s timeout; only the 5 s training timeout explains a quick failure.
    (outcome, seconds), _ = run_ranks(_one_rank_goes_silent, 2, str(tmp_path), collective_timeout=60)
    assert outcome not in ("finished", "silent"), outcome
    assert seconds < 30, seconds


def _bf16_single_device(rank: int, world_size: int, dump: str) -> dict:
    trainer = make_trainer(dump, "--training.steps=2", "--training.mixed_precision_param=bfloat16")
    model = trainer.model_parts[0]
    logits = model(torch.zeros(1, 8, dtype=torch.long))
    losses = trainer.train()
    return {"dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
            "param_dtype": {p.dtype for p in model.parameters()}, "logits_dtype": logits.dtype, "losses": losses}


def test_one_device_still_gets_the_mixed_precision_policy(tmp_path):
    # A single GPU has nothing to shard; FSDP2 on a one-rank mesh is what gives it bf16 compute.
    (out,) = run_ranks(_bf16_single_device, 1, str(tmp_path))
    assert out["dtensor"] and out["param_dtype"] == {torch.float32}  # float32 master weights
    assert out["logits_dtype"] == torch.bfloat16
    assert all(torch.isfinite(torch.tensor(out["losses"])))


def _bf16_run(rank: int, world_size: int, dump: str, *overrides: str) -> dict:
    trainer = make_trainer(dump, "--training.steps=3", "--training.batch_size=2",
                           "--training.mixed_precision_param=bfloat16", *overrides)
    seen: set[torch.dtype] = set()
    for part in trainer.model_parts:
        for module in part.modules():
            if isinstance(module, torch.nn.Linear):
                # Inside forward FSDP2 has swapped in the compute-dtype copy of the weight.
                module.register_forward_pre_hook(lambda mod, args: seen.add(mod.weight.dtype))
    losses = trainer.train()
    return {"compute_dtypes": seen,
            "master_dtypes": {p.dtype for part in trainer.model_parts for p in part.parameters()},
            "losses": losses}


def test_layouts_without_data_parallelism_compute_in_the_configured_dtype(tmp_path):
    # TP and PP alone have nothing for FSDP to shard, yet FSDP2 is what applies the bf16 policy:
    # they get it on a one-rank mesh (sharing TP's root mesh), as one device does, so every
    # layout trains the same bf16-compute model. Before, they silently computed in float32.
    (one,) = run_ranks(_bf16_run, 1, str(tmp_path / "one"))
    assert one["compute_dtypes"] == {torch.bfloat16} and one["master_dtypes"] == {torch.float32}
    for name, overrides in {"tp2": ["--parallelism.tensor_parallel_degree=2"],
                            "pp2": ["--parallelism.pipeline_parallel_degree=2"]}.items():
        outs = run_ranks(_bf16_run, 2, str(tmp_path / name), *overrides)
        for out in outs:
            assert out["compute_dtypes"] == {torch.bfloat16}, (name, out["compute_dtypes"])
            assert out["master_dtypes"] == {torch.float32}, name
        # Same data, same init, same bf16 compute: only the summation order differs (bf16 rounding).
        for got, want in zip(outs[0]["losses"], one["losses"], strict=True):
            assert abs(got - want) < 2e-3 * want, (name, outs[0]["losses"], one["losses"])


class _LogitPeak(TokenTerm):
    """A loss term no module ships (a logit statistic): trained with weight 0, its window's peak logged."""

    name = "logit_peak"

    def __init__(self) -> None:
        self.peak = 0.0

    def __call__(self, outputs: tuple[torch.Tensor, ...], labels: torch.Tensor) -> torch.Tensor:
        self.peak = max(self.peak, float(outputs[0].detach().amax()))
        return outputs[0].amax() * 0.0

    def metrics(self, groups) -> dict[str, float]:
        peak, self.peak = self.peak, 0.0
        return {self.name: peak}


def test_tokens_per_second_count_the_wait_for_the_device(tmp_path, monkeypatch):
    """On a GPU the host runs ahead of the device until the loss read of a log step waits for it; a log window's
    tokens/s must count that wait. A read that sleeps stands in for the device's backlog here (step 2's read: the
    first step also pays for the set-up). The same run has a loss term added in one registration
    (``LOSS_TERMS``): it is trained and logged with no other change. It trains MuonClip, which the trainer wires
    (QK-clip after each step, its max-logit term logged)."""
    from torchtitan.train_step import build as build_module

    monkeypatch.setattr(build_module, "LOSS_TERMS", (*build_module.LOSS_TERMS, lambda sources: _LogitPeak()))
    trainer = conftest.make_trainer(tmp_path, "--metrics.log_freq=1", "--training.steps=2", "--optimizer.name=MuonClip")
    backlog_s, read, reads = 2.0, trainer.readout.read, []

    def read_after_the_device(*args, **kwargs):
        reads.append(1)
        time.sleep(backlog_s if len(reads) == 2 else 0)
        return read(*args, **kwargs)

    logged: list[dict] = []
    log = trainer.metrics_logger.log
    monkeypatch.setattr(trainer.readout, "read", read_after_the_device)
    monkeypatch.setattr(trainer.metrics_logger, "log",
                        lambda step, metrics: (logged.append(metrics), log(step, metrics)))
    try:
        trainer.train()
    finally:  # the trainer's one-rank group lives in this pytest process: end it as train.py does
        trainer.close()
        shutdown_distributed(ok=True, timeout_seconds=60)
    second = [m for m in logged if "step_time_s" in m][1]
    assert [term.name for term in trainer.runner.objective.terms] == ["loss", "attn/max_logit", "logit_peak"]
    assert all(m["logit_peak"] > 0 for m in logged if "step_time_s" in m)  # each step's own log entry
    assert all(m["attn/max_logit"] > 0 for m in logged if "step_time_s" in m)  # measured and reduced after each step
    assert second["step_time_s"] >= backlog_s
    assert second["tps"] <= trainer.cfg.training.batch_size * trainer.cfg.training.seq_len / backlog_s
