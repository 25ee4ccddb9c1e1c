"""Per-device throughput, MFU and ETA bookkeeping for the training loop.

Pure Python on purpose: no torch.distributed and no device syncs. The trainer
decides when timings are meaningful (e.g. after ``loss.item()`` has already
synchronized the device on a log step).
"""

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ThroughputStats:
    """Averages over the steps recorded since the last ``reset_window``."""

    steps: int
    step_time_s: float  # mean wall time of one step
    tokens_per_s: float  # per device
    data_pct: float  # share of step time spent waiting for the data loader
    eta_s: float  # mean step time x steps still to run
    tflops: float | None  # per device; None without a FLOPs-per-token estimate
    mfu_pct: float | None  # None when the device peak is unknown (e.g. CPU)

    def as_metrics(self) -> dict[str, float]:
        """Flat metric dict for logging; unknown values are left out."""
        metrics = {
            "step_time_s": self.step_time_s,
            "tps": self.tokens_per_s,
            "data_pct": self.data_pct,
            "eta_s": self.eta_s,
        }
        if self.tflops is not None:
            metrics["tflops"] = self.tflops
        if self.mfu_pct is not None:
            metrics["mfu_pct"] = self.mfu_pct
        return metrics


class Throughput:
    """Accumulates step timings over a log window.

    Use either ``step_begin()`` / ``data_loaded()`` / ``step_end(tokens)``
    around each step, or ``record(...)`` with timings measured elsewhere.
    ``tokens`` is always the number of tokens this device processed.
    """

    def __init__(
        self,
        *,
        total_steps: int,
        flops_per_token: float | None = None,
        peak_flops: float | None = None,
        start_step: int = 0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.total_steps = total_steps
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        # Steps completed so far, including those before a checkpoint resume.
        self.step = start_step
        self._clock = clock
        self._step_start: float | None = None
        self._data_end: float | None = None
        self.reset_window()

    def reset_window(self) -> None:
        """Forget the timings of the current window (call after logging)."""
        self._window_steps = 0
        self._window_step_time = 0.0
        self._window_data_time = 0.0
        self._window_tokens = 0

    def step_begin(self) -> None:
        self._step_start = self._clock()
        self._data_end = None

    def data_loaded(self) -> None:
        """Mark the end of data loading inside the current step."""
        self._data_end = self._clock()

    def step_end(self, tokens: float) -> None:  # a device's share of a batch may be fractional
        if self._step_start is None:
            raise RuntimeError("step_end() called without step_begin()")
        now = self._clock()
        # Without a data_loaded() mark the step counts as pure compute.
        data_end = self._data_end if self._data_end is not None else self._step_start
        self.record(now - self._step_start, data_end - self._step_start, tokens)
        self._step_start = None

    def record(self, step_time_s: float, data_time_s: float, tokens: float) -> None:
        """Add one finished step to the window."""
        self.step += 1
        self._window_steps += 1
        self._window_step_time += step_time_s
        self._window_data_time += data_time_s
        self._window_tokens += tokens

    def stats(self) -> ThroughputStats | None:
        """Window averages, or None when no step was recorded since the reset."""
        if self._window_steps == 0:
            return None
        total_time = self._window_step_time
        mean_step_time = total_time / self._window_steps
        tokens_per_s = self._window_tokens / total_time if total_time > 0 else 0.0
        data_pct = 100.0 * self._window_data_time / total_time if total_time > 0 else 0.0

        tflops = None
        mfu_pct = None
        if self.flops_per_token is not None:
            flops_per_s = self.flops_per_token * tokens_per_s
            tflops = flops_per_s / 1e12
            if self.peak_flops:
                mfu_pct = 100.0 * flops_per_s / self.peak_flops

        remaining_steps = max(self.total_steps - self.step, 0)
        return ThroughputStats(
            steps=self._window_steps,
            step_time_s=mean_step_time,
            tokens_per_s=tokens_per_s,
            data_pct=data_pct,
            eta_s=mean_step_time * remaining_steps,
            tflops=tflops,
            mfu_pct=mfu_pct,
        )

    def metrics(self) -> dict[str, float]:
        """``stats().as_metrics()``, or an empty dict for an empty window."""
        stats = self.stats()
        return stats.as_metrics() if stats is not None else {}
