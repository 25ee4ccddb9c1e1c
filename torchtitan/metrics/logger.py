"""Metric sinks: TensorBoard scalars, W&B (metrics/wandb_run.py), and the console lines with the patterns
that read those lines.

The console lines are an interface: ``tests/integration_tests.py`` reads the step, the
validation and the mesh lines of every run with ``STEP_LINE``, ``VALIDATION_LINE`` and
``MESH_LINE`` (each match gives the rank and then the fields), and ``scripts/loss_compare.py``
reads a run's batch arithmetic with ``BATCH_LINE``. Change a format and its pattern together;
tests/metrics/test_log_lines.py checks that they agree.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

from torchtitan.logging_setup import LINE_PREFIX_RE
from torchtitan.metrics.wandb_run import WandbRun

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

logger = logging.getLogger(__name__)

STEP_LINE = re.compile(LINE_PREFIX_RE + r"step: (\d+)\s+loss: (\S+)")  # rank, step, loss
VALIDATION_LINE = re.compile(LINE_PREFIX_RE + r"validation step: (\d+)\s+loss: (\S+)")  # rank, step, loss
MESH_LINE = re.compile(LINE_PREFIX_RE + r"World mesh (\{.*?\})")  # rank, {dim: size} as a Python literal
# local batch, sequence length, micro-steps, data-parallel degree (anywhere in a log: no rank prefix needed)
BATCH_LINE = re.compile(r"Training \d+ steps: local batch (\d+) x seq (\d+), (\d+) micro-step\(s\), dp degree (\d+)")


class MetricsLogger:
    """Writes scalar metrics to TensorBoard and, when given one, a W&B run, from a single rank.

    Every rank may construct and call it; only ``rank == log_rank`` writes, so
    the trainer needs no rank checks around logging calls. The SummaryWriter
    is created on the first ``log`` so that ranks and runs that never log
    leave no empty event files behind. The W&B run opens at ``start(step)``,
    the step training starts from (past 0 when resumed from a checkpoint), or
    at the first ``log`` as a new run.
    """

    def __init__(
        self,
        log_dir: str | None,
        enable_tensorboard: bool,
        rank: int,
        log_rank: int = 0,
        wandb_run: WandbRun | None = None,
    ) -> None:
        self.log_dir = log_dir
        self.rank = rank
        self.log_rank = log_rank
        self.enabled = enable_tensorboard and rank == log_rank
        if self.enabled and log_dir is None:
            logger.warning("TensorBoard is enabled but no log_dir was given; not writing")
            self.enabled = False
        self._writer: SummaryWriter | None = None
        self.wandb_run = wandb_run if rank == log_rank else None
        self._wandb_started = False

    def _get_writer(self) -> SummaryWriter:
        if self._writer is None:
            # Imported here: tensorboard is only needed when it is enabled.
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=self.log_dir)
        return self._writer

    def start(self, step: int) -> None:
        """Training starts after ``step`` (0: a new run; past 0: resumed, the W&B run continues)."""
        if self.wandb_run is not None and not self._wandb_started:
            self.wandb_run.start(step)
            self._wandb_started = True

    def log(self, step: int, metrics: Mapping[str, float | None]) -> None:
        """Write each metric as a scalar at ``step``; None values are skipped."""
        scalars = {name: float(value) for name, value in metrics.items() if value is not None}
        if self.enabled:
            writer = self._get_writer()
            for name, value in scalars.items():
                writer.add_scalar(name, value, global_step=step)
        if self.wandb_run is not None:
            self.start(0)
            self.wandb_run.log(step, scalars)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self.wandb_run is not None:
            self.wandb_run.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def format_duration(seconds: float) -> str:
    """h:mm:ss, with hours allowed past 24 (long runs)."""
    if not math.isfinite(seconds):
        return "?"
    total = max(int(round(seconds)), 0)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def _memory_field(metrics: Mapping[str, float | None]) -> str | None:
    # Key names follow torchtitan.metrics.device_info.device_memory.
    reserved = metrics.get("max_reserved_gib")
    if reserved is not None:
        pct = metrics.get("max_reserved_pct")
        suffix = f" ({pct:.1f}%)" if pct is not None else ""
        return f"memory: {reserved:.2f}GiB{suffix}"
    peak_rss = metrics.get("peak_rss_gib")
    if peak_rss is not None:
        return f"memory: {peak_rss:.2f}GiB rss"
    return None


def format_mesh_line(dim_names: tuple[str, ...], shape: tuple[int, ...]) -> str:
    return f"World mesh {dict(zip(dim_names, shape))}"


def format_batch_line(steps: int, local_batch: int, seq_len: int, micro_steps: int, dp_degree: int) -> str:
    return (f"Training {steps} steps: local batch {local_batch} x seq {seq_len}, {micro_steps} micro-step(s), "
            f"dp degree {dp_degree}")


def format_validation_line(step: int, loss: float, perplexity: float, tokens: int, batches: int, trained: int,
                           bpb: float | None = None) -> str:
    shown = "" if bpb is None else f"  bpb: {bpb:.4g}"
    return (f"validation step: {step}  loss: {loss:.5g}  perplexity: {perplexity:.5g}{shown}  tokens: {tokens:,} "
            f"({batches} batch(es))  trained on: {trained:,} tokens")


def format_step_line(step: int, metrics: Mapping[str, float | None]) -> str:
    """One console line for a log step; fields missing from ``metrics`` are left out.

    Read keys: loss, z_loss, grad_norm, lr, skipped_steps ([stability]), tps, tflops, mfu_pct, max_reserved_gib /
    max_reserved_pct (CUDA) or peak_rss_gib (CPU), data_pct, eta_s, and a mixture's
    ``data/tokens/<source>`` (tokens each source gave so far) as one compact field, and a model with
    experts' ``moe/...`` (imbalance, auxiliary loss, fewest and most tokens per expert) as another;
    ``mtp/loss`` (multi-token prediction) beside the loss, ``attn/max_logit`` (QK-clip), and downstream scores
    (``eval/<task>/<score>``) as a last.
    """
    fields = [f"step: {step}"]

    def add(key: str, template: str) -> None:
        value = metrics.get(key)
        if value is not None:
            fields.append(template.format(value))

    add("loss", "loss: {:.5g}")
    add("mtp/loss", "mtp_loss: {:.5g}")  # multi-token prediction's, apart from the main loss
    add("z_loss", "z_loss: {:.4g}")
    add("attn/max_logit", "max_logit: {:.4g}")  # QK-clip's (MuonClip): the largest attention logit of the step
    add("grad_norm", "grad_norm: {:.4f}")
    add("lr", "lr: {:.1e}")
    add("skipped_steps", "skipped: {:.0f}")
    add("tps", "tps: {:,.0f}")
    add("tflops", "tflops: {:.2f}")
    add("mfu_pct", "mfu: {:.2f}%")
    memory = _memory_field(metrics)
    if memory is not None:
        fields.append(memory)
    add("data_pct", "data: {:.1f}%")
    eta = metrics.get("eta_s")
    if eta is not None:
        fields.append(f"eta: {format_duration(eta)}")
    mix = [(key[len(_MIX_PREFIX):], value) for key, value in metrics.items()
           if key.startswith(_MIX_PREFIX) and value is not None]
    if mix:
        fields.append("mix: " + " ".join(f"{name} {format_count(value)}" for name, value in mix))
    moe = _moe_field(metrics)
    if moe is not None:
        fields.append(moe)
    scores = _eval_field(metrics)
    if scores is not None:
        fields.append(scores)
    return "  ".join(fields)


_EVAL_PREFIX = "eval/"


def _eval_field(metrics: Mapping[str, float | None]) -> str | None:
    """Downstream scores: ``eval: continuation acc 0.312 acc_norm 0.305 bpb 2.14``, task after task."""
    tasks: dict[str, list[str]] = {}
    for key, value in metrics.items():
        if key.startswith(_EVAL_PREFIX) and value is not None:
            task, _, score = key[len(_EVAL_PREFIX):].rpartition("/")
            tasks.setdefault(task, []).append(f"{score} {value:.4g}")
    if not tasks:
        return None
    return "eval: " + " | ".join(f"{task} {' '.join(parts)}" for task, parts in tasks.items())


_EXPERT_PREFIX = "moe/tokens_per_expert/"


def _moe_field(metrics: Mapping[str, float | None]) -> str | None:
    """A model with experts: ``moe: imbalance 1.31 (max 1.90) aux 1.02 tokens/expert 1.2K-3.4K``."""
    if metrics.get("moe/imbalance") is None and metrics.get("moe/aux_loss") is None:
        return None
    parts = []
    if metrics.get("moe/imbalance") is not None:
        parts.append(f"imbalance {metrics['moe/imbalance']:.2f} (max {metrics.get('moe/imbalance_max') or 0:.2f})")
    if metrics.get("moe/aux_loss") is not None:
        parts.append(f"aux {metrics['moe/aux_loss']:.4g}")
    tokens = [v for k, v in metrics.items() if k.startswith(_EXPERT_PREFIX) and v is not None]
    if tokens:
        parts.append(f"tokens/expert {format_count(min(tokens))}-{format_count(max(tokens))}")
    return "moe: " + " ".join(parts)


_MIX_PREFIX = "data/tokens/"


def format_count(value: float) -> str:
    """A count in 4 characters or so: 950, 12.3K, 4.56M, 7.89B, 1.2T."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.0f}"
