"""Labels for process groups made outside the layout's meshes (the two-hop expert dispatch's groups).

The planner's traffic ledger names each collective's group by its mesh dimension (``ParallelDims.group_labels``); a
group that no mesh holds is labelled here by whoever makes it, so that its traffic is priced on its own ranks
instead of being lumped with other unknown groups.
"""

from __future__ import annotations

import torch.distributed as dist

_LABELS: dict[str, str] = {}


def label_group(group: dist.ProcessGroup, label: str) -> None:
    """Name ``group``'s traffic ``label`` in the planner's ledger."""
    _LABELS[group.group_name] = label


def extra_group_labels() -> dict[str, str]:
    """Process-group name -> label, for the groups labelled with ``label_group``."""
    return dict(_LABELS)
