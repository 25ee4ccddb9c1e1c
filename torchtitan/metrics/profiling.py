"""torch.profiler traces every ``profile_freq`` steps, one Chrome trace per rank."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import torch

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def maybe_profile(enabled: bool, folder: str, profile_freq: int, rank: int) -> Iterator[torch.profiler.profile | None]:
    """Yield a profiler whose ``step()`` the loop calls once per step (None when disabled).

    Each cycle of ``profile_freq`` steps waits, warms up one step and records the last
    one, so a trace shows a steady-state step. Traces go to
    ``folder/iteration_<step>/rank<rank>_trace.json`` (open them in Perfetto or chrome://tracing).
    """
    if not enabled:
        yield None
        return
    warmup = 1 if profile_freq > 1 else 0
    wait = max(profile_freq - warmup - 1, 0)

    def save(prof: torch.profiler.profile) -> None:
        out = os.path.join(folder, f"iteration_{prof.step_num}")
        os.makedirs(out, exist_ok=True)
        prof.export_chrome_trace(os.path.join(out, f"rank{rank}_trace.json"))
        logger.info("Saved profiler trace to %s", out)

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=wait, warmup=warmup, active=1),
        on_trace_ready=save,
    ) as prof:
        yield prof
