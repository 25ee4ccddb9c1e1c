"""The planner's progress on stderr: what it simulates, and how many of how many.

A large plan runs for minutes (each simulated rank runs its step op by op), and a planner that says
nothing meanwhile cannot be told from a hung one. Lines go to stderr, so that stdout keeps only the
report (``--json`` stays one JSON object). Library callers (the tests) pass no ``Progress`` and get no lines.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the command line imports this module before torch: --help stays fast
    from torchtitan.launch_plan import LaunchPlan


class Progress:
    """Prints ``plan [<seconds since start>]: <what>`` lines; holds no stream, so the pool's workers can take it."""

    def __init__(self) -> None:
        self.started = time.monotonic()

    def say(self, text: str) -> None:
        print(f"plan [{time.monotonic() - self.started:7.1f} s]: {text}", file=sys.stderr, flush=True)


def simulation_label(rank: int, plan: LaunchPlan, job: int, jobs: int) -> str:
    """What one simulation is: its rank, its layout among several, and the blocks and micro-batches it runs."""
    microbatches = plan.grad_accum if plan.pipeline is None else plan.pipeline.microbatches
    layout = f" of layout {job + 1}/{jobs}" if jobs > 1 else ""
    return f"rank {rank}{layout}, {plan.model_args.n_layers} blocks, {microbatches} micro-batch(es)"
