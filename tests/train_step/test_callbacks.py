"""The step callbacks: every point of a step, in order, with what it carries; a callback sees the trainer's own
state at each point (the gradients at ``GRADIENTS_READY``, the step's output at ``STEP_END``)."""

from __future__ import annotations

import pytest
import torch
from conftest import REPO
from dist_harness import run_ranks

from torchtitan.config import ConfigManager
from torchtitan.train_step.callbacks import StepEvent, StepPoint

pytestmark = pytest.mark.slow  # a gloo world of one process
CONFIG = str(REPO / "train_configs" / "debug_model_ci.toml")


def _events(rank: int, world_size: int, dump: str, overrides: list[str]) -> dict:
    from torchtitan.trainer import Trainer

    cfg = ConfigManager().parse_args([
        f"--job.config_file={CONFIG}", f"--job.dump_folder={dump}", "--metrics.enable_tensorboard=false",
        "--training.steps=2", "--training.batch_size=2", "--training.gradient_accumulation_steps=2", *overrides])
    seen, grads, outputs = [], [], []

    def watch(event: StepEvent) -> None:
        seen.append((event.point.value, event.step, event.micro_batch))
        params = event.strategy.parts.runner.parameters()
        if event.point is StepPoint.GRADIENTS_READY:
            grads.append(all(p.grad is not None for p in params))
        if event.point is StepPoint.STEP_END:
            grads.append(any(p.grad is not None for p in params))  # zero_grad has run
            outputs.append((event.output.step, float(event.output.loss)))

    trainer = Trainer(cfg, callbacks=[watch])
    return {"seen": seen, "grads": grads, "outputs": outputs, "losses": trainer.train()}


def _plain_step(step: int) -> list[tuple[str, int, int | None]]:
    micro = [(point, step, i) for i in range(2)
             for point in ("micro_batch_start", "forward_end", "backward_start", "micro_batch_end")]
    return [("step_start", step, None), *micro, ("gradients_ready", step, None), ("optimizer_step", step, None),
            ("step_end", step, None)]


def test_every_point_of_a_step_in_order(tmp_path):
    (out,) = run_ranks(_events, 1, str(tmp_path), [])
    assert out["seen"] == _plain_step(1) + _plain_step(2)
    assert out["grads"] == [True, False, True, False]
    assert out["outputs"] == [(1, out["losses"][0]), (2, out["losses"][1])]


def test_pipeline_steps_call_the_micro_batch_points(tmp_path):
    # Through the pipeline schedule a micro-batch is one schedule step: no forward_end/backward_start.
    out = run_ranks(_events, 2, str(tmp_path), ["--parallelism.pipeline_parallel_degree=2",
                                                 "--parallelism.data_parallel_shard_degree=1",
                                                 "--parallelism.pipeline_parallel_microbatches=2"])
    expected = [e for e in _plain_step(1) + _plain_step(2) if e[0] not in ("forward_end", "backward_start")]
    assert [r["seen"] for r in out] == [expected, expected]
    assert out[0]["losses"] == out[1]["losses"] and all(torch.isfinite(torch.tensor(out[0]["losses"])))


def _moe_tail(rank: int, world_size: int, dump: str, overrides: list[str]) -> dict:
    from torchtitan.trainer import Trainer

    cfg = ConfigManager().parse_args([
        f"--job.config_file={REPO / 'train_configs' / 'qwen3_debug_moe.toml'}", f"--job.dump_folder={dump}",
        "--metrics.enable_tensorboard=false", "--training.steps=1", "--training.batch_size=1",
        "--training.seq_len=32", "--training.gradient_accumulation_steps=2", "--moe.load_balance_coeff=0.001",
        "--lr_scheduler.warmup_steps=0"])
    seen: dict[str, tuple[float, int]] = {}
    tokens: list[int] = []

    def watch(event: StepEvent) -> None:
        experts = event.strategy.parts.runner.experts
        if event.point in (StepPoint.OPTIMIZER_STEP, StepPoint.STEP_END):
            moved = sum(float(m.expert_bias.abs().sum()) for m in experts.moes)
            seen[event.point.value] = (moved, sum(int(m.tokens_per_expert.sum()) for m in experts.moes))
        if event.point is StepPoint.STEP_END:
            tokens.append(event.output.tokens)

    trainer = Trainer(cfg, callbacks=[watch])
    trainer.train()
    return {"seen": seen, "tokens": tokens, "pre_hooks": len(trainer.runner.optimizer._optimizer_step_pre_hooks)}


def test_the_tail_moves_the_routing_bias_before_the_optimizer_step(tmp_path):
    """The bias update is the tail's own point (no optimizer hook): at OPTIMIZER_STEP the counts of both
    micro-batches wait and the biases are zero; when the step ends they have moved and the counts are zeroed.
    The step reports the tokens it read (the trainer's throughput): 2 micro-batches x 32."""
    (out,) = run_ranks(_moe_tail, 1, str(tmp_path), [])
    before, after = out["seen"]["optimizer_step"], out["seen"]["step_end"]
    assert before[0] == 0 and before[1] == 2 * 32 * 2 * 3, before  # tokens x top-2 x the 3 sparse layers
    assert after[0] > 0 and after[1] == 0, after
    assert out["pre_hooks"] == 0
    assert out["tokens"] == [2 * 32]
