"""A step that does not log, validate or checkpoint reads no device value on the host.

On an accelerator such a read waits for the device and loses the overlap of the next step's
launch. Every host read of a tensor's value goes through ``aten._local_scalar_dense``
(``item()``, ``float()``, ``int()``, ``bool()``) or ``tolist()``: a dispatch mode records
the first, a wrapper the second, on the training thread of a real 2-rank FSDP run with
``metrics.log_freq 10``, checkpointing on (interval 100) and no validation. Steps 2-9 must
make none; step 10 logs, saves and checks for preemption, and must make some (so the
counter sees real reads). The run has [stability] on (docs/stability.md): the bad-step guard with
its spike detector and rollback flag, z-loss, and a NaN gradient at step 4 that the guard skips, so
judging and skipping a step read nothing either (the plain step runs the same code without them).
Adam's ``step`` counters are excluded: optimizers keep them on the host (not fused, not
capturable), where reading them waits for nothing.

The run trains ``causal``: under ``block_causal`` the eager-CPU kernel splits each row at its
document boundaries, which it reads from host memory (a CPU tensor, so nothing waits); the
CUDA path builds its block mask on the device (models/attention.py).
"""

from __future__ import annotations

import traceback

import pytest
import torch
from conftest import CI_CONFIG
from dist_harness import run_ranks
from torch.utils._python_dispatch import TorchDispatchMode

from torchtitan.train_step.callbacks import StepEvent, StepPoint

pytestmark = pytest.mark.slow  # every test here starts processes

CONFIG = CI_CONFIG
STEPS = 10


class HostReads(TorchDispatchMode):
    """Records every host read of a tensor's value with the trainer's current step and where it was made."""

    def __init__(self, trainer, skip: set[int]):
        super().__init__()
        self.trainer, self.skip, self.reads = trainer, skip, []

    def note(self, what: str, tensor: torch.Tensor) -> None:
        if id(tensor) not in self.skip:
            where = "".join(traceback.format_stack(limit=8)[:-2])
            self.reads.append((self.trainer.step, what, where))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.note("item", args[0])
        return func(*args, **(kwargs or {}))


def _count_reads(rank: int, world_size: int, dump: str) -> list[tuple[int, str, str]]:
    from torchtitan.config import ConfigManager
    from torchtitan.trainer import Trainer

    cfg = ConfigManager().parse_args([
        f"--job.config_file={CONFIG}", f"--job.dump_folder={dump}", "--metrics.enable_tensorboard=false",
        "--parallelism.data_parallel_shard_degree=2", "--training.batch_size=2",
        "--training.gradient_accumulation_steps=2", f"--training.steps={STEPS}", "--metrics.log_freq=10",
        "--checkpoint.enable_checkpoint", "--checkpoint.interval=100", "--model.attn_mask_type=causal",
        "--stability.skip_nonfinite_steps", "--stability.skip_spikes", "--stability.spike_warmup_steps=2",
        "--stability.rolling_interval_length=4", "--stability.max_consecutive_skips=3",
        "--stability.z_loss_multiplier=1e-4", "--debug.inject_nonfinite_grad=4"])
    trainer = Trainer(cfg)
    real_tolist = torch.Tensor.tolist
    mode: HostReads | None = None

    def watch_from_step_2(event: StepEvent) -> None:
        nonlocal mode
        if event.point is StepPoint.STEP_START and event.step == 2:
            # From step 2 on: Adam's step counters exist, the first step's set-up is done.
            skip = {id(s["step"]) for s in trainer.optimizer.state.values()}
            mode = HostReads(trainer, skip).__enter__()

    def tolist(self):
        if mode is not None:
            mode.note("tolist", self)
        return real_tolist(self)

    trainer.callbacks.add(watch_from_step_2)
    torch.Tensor.tolist = tolist
    try:
        trainer.train()
    finally:
        torch.Tensor.tolist = real_tolist
        if mode is not None:
            mode.__exit__(None, None, None)
    assert trainer.guard is not None and int(trainer.guard.skipped) == 1, "the NaN gradient of step 4 was skipped"
    return mode.reads


def test_no_host_read_on_quiet_steps(tmp_path):
    for rank, reads in enumerate(run_ranks(_count_reads, 2, str(tmp_path), timeout=300)):
        quiet = [(step, what, where) for step, what, where in reads if 2 <= step < STEPS]
        assert not quiet, f"rank {rank}: host reads on steps 2-{STEPS - 1}:\n" + "\n".join(
            f"step {step}: {what} at\n{where}" for step, what, where in quiet)
        assert any(step == STEPS for step, _, _ in reads), f"rank {rank}: the logging step {STEPS} read nothing"
