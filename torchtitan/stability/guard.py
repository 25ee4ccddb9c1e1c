"""Whether to skip an optimizer step, decided on the device before the step, the same on every rank.

The decision is made from the step's world-reduced values: the global loss (summed over dp x cp, the
pipeline stages and, under fault tolerance, the live groups) and the global gradient norm (reduced over
every shard, stage and group). Every rank holds the same bits of both, so every rank of every layout
takes the same decision without another collective.

A bad step is one whose loss or gradient norm is not finite (``skip_nonfinite_steps``), or, with
``skip_spikes``, exceeds its running mean by ``sigma_factor`` standard deviations once
``spike_warmup_steps`` steps were accepted. It is skipped through the fused Adam kernel's
``found_inf``: the kernel leaves the parameters, both moments and the step count as they are, and
with ``found_inf`` 0 it computes the very update it computes without it (so a run with the guard on
and no bad step trains bitwise as one with it off). The LR schedule follows the training step, as it
does without skipping: a skipped step uses up its learning rate.

Nothing here reads a device value on the host: the counters are tensors the trainer reads with the loss.
"""

from __future__ import annotations

import torch

from torchtitan.config.job_config import Stability
from torchtitan.stability.running_stats import RunningStats


class BadStepGuard:
    """The skip decision, its counters and the spike detector's statistics; a checkpoint state (tensors only)."""

    def __init__(self, cfg: Stability, device: torch.device):
        self.skip_nonfinite, self.skip_spikes = cfg.skip_nonfinite_steps, cfg.skip_spikes
        self.sigma, self.warmup = cfg.sigma_factor, cfg.spike_warmup_steps
        self.max_consecutive = cfg.max_consecutive_skips
        self.loss_stats = RunningStats(cfg.rolling_interval_length, device)
        self.norm_stats = RunningStats(cfg.rolling_interval_length, device)
        zero = torch.zeros((), dtype=torch.int64, device=device)
        self.skipped = zero.clone()  # steps skipped over the run (resumes from a checkpoint)
        self.consecutive = zero.clone()  # skipped in a row up to the last step
        self.rollback_due = zero.clone()  # 1 once max_consecutive_skips were skipped in a row: sticky until cleared
        self.data_steps_skipped = zero.clone()  # steps' worth of data that rollbacks passed over (rollback.py)

    @staticmethod
    def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
        """The skip goes through the fused kernel's ``found_inf``; the foreach and for-loop kernels have none."""
        if not optimizer.defaults.get("fused"):
            raise ValueError("[stability] skipping needs the fused Adam/AdamW kernel, which this device or parameter "
                             "dtype lacks; turn off --stability.skip_nonfinite_steps and --stability.skip_spikes")

    def decide(self, optimizer: torch.optim.Optimizer, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """Whether this step is bad (a 0-dim bool tensor); tells ``optimizer`` to skip it, updates the counters."""
        loss, grad_norm = loss.detach().double(), grad_norm.detach().to(loss.device, torch.float64)
        finite = torch.isfinite(loss) & torch.isfinite(grad_norm)
        bad = ~finite if self.skip_nonfinite else torch.zeros_like(finite)
        if self.skip_spikes:
            bad = bad | self._spike(loss, grad_norm)
            accept = finite & ~bad
            self.loss_stats.add(loss, accept)
            self.norm_stats.add(grad_norm, accept)
        bad_count = bad.to(torch.int64)
        self.skipped += bad_count
        self.consecutive.copy_((self.consecutive + 1) * bad_count)
        if self.max_consecutive:
            self.rollback_due |= (self.consecutive >= self.max_consecutive).to(torch.int64)
        # On the parameters' device, as the fused kernel wants it (float32, exactly 1.0 to skip).
        setattr(optimizer, "found_inf", bad.to(torch.float32))  # noqa: B010 - Adam.step reads it by getattr
        return bad

    def _spike(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        ready = self.loss_stats.count >= self.warmup
        loss_mean, loss_std = self.loss_stats.mean_std()
        norm_mean, norm_std = self.norm_stats.mean_std()
        return ready & ((loss > loss_mean + self.sigma * loss_std) | (grad_norm > norm_mean + self.sigma * norm_std))

    def after_rollback(self, data_steps: int) -> None:
        """A rollback reloaded a checkpoint (and this state with it) and passed over ``data_steps`` more steps' data."""
        self.consecutive.zero_()
        self.rollback_due.zero_()
        self.data_steps_skipped += data_steps

    def state_dict(self) -> dict[str, object]:
        return {"loss": self.loss_stats.state_dict(), "grad_norm": self.norm_stats.state_dict(),
                "skipped": self.skipped, "consecutive": self.consecutive, "rollback_due": self.rollback_due,
                "data_steps_skipped": self.data_steps_skipped}

    def load_state_dict(self, state: dict) -> None:
        self.loss_stats.load_state_dict(state["loss"])
        self.norm_stats.load_state_dict(state["grad_norm"])
        for name in ("skipped", "consecutive", "rollback_due", "data_steps_skipped"):
            getattr(self, name).copy_(state[name])
