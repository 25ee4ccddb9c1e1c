"""Two torchft lines that carry no information where this project runs them, filtered narrowly.

Each filter matches one message from one source, and only where the message says nothing:

- "Unable to reset NCCL flight recorder recording so traces will be incorrect": a Python
  ``logging`` warning of the ``torchft.manager`` logger, at every quorum that changes the
  cross-group process group. torchft prints it when torch lacks
  ``_reset_fr_recording_nccl``, which only builds with NCCL have. The flight recorder
  traces NCCL collectives only, so a build without NCCL (the CPU build, gloo) has no
  recording that could be reset or be incorrect. Builds with NCCL never print it; the
  filter is installed only where the function is missing.
- "The given buffer is not writable ...": a ``UserWarning`` that torch raises from C++ (once
  per process) when ``torch.frombuffer`` wraps the immutable ``bytes`` received in a heal
  (``torch.distributed._serialization``, which torchft's HTTP transport reads a peer's state
  with). It warns that writing to such a tensor would write into those bytes. Nothing does:
  the heal copies every received tensor into the group's own memory and drops it
  (``HealState.load_state_dict``; under DiLoCo, torchft copies the reference parameters and the
  outer optimizers copy their state on load, see ``semi_sync.outer_optimizer``). The filter
  matches that message from that module only.
"""

from __future__ import annotations

import logging
import warnings

from torchtitan.compat import flight_recorder_reset_exists

FLIGHT_RECORDER = "Unable to reset NCCL flight recorder recording"
NOT_WRITABLE = "The given buffer is not writable"


class _DropMessage(logging.Filter):
    """Drops the records of one logger whose message contains ``text``."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def quiet_torchft() -> None:
    """Install both filters (idempotent)."""
    if not flight_recorder_reset_exists():
        manager_logger = logging.getLogger("torchft.manager")
        if not any(isinstance(f, _DropMessage) for f in manager_logger.filters):
            manager_logger.addFilter(_DropMessage(FLIGHT_RECORDER))
    warnings.filterwarnings("ignore", message=NOT_WRITABLE, category=UserWarning,
                            module=r"torch\.distributed\._serialization")
