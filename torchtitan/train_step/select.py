"""Which step strategy a job runs: the plain step, or one replica group's step under fault tolerance.

Above both: ``fault_tolerance`` builds on ``train_step.base``, and only this module chooses
between them, so the trainer holds one ``StepStrategy`` and never asks which one.
"""

from __future__ import annotations

import torch

from torchtitan.config.job_config import FaultTolerance
from torchtitan.train_step.base import StepParts, StepStrategy
from torchtitan.train_step.plain import PlainStep


def build_step_strategy(ft: FaultTolerance, parts: StepParts, device: torch.device) -> StepStrategy:
    """The step this process runs (``ft``: the ``[fault_tolerance]`` section); under fault tolerance it also
    starts torchft's manager."""
    if not ft.enable:
        return PlainStep(parts)
    from torchtitan.fault_tolerance.setup import build_fault_tolerant_step  # imports torchft

    return build_fault_tolerant_step(ft, parts, device)
