"""Labels for process groups made outside the layout's meshes (the two-hop expert dispatch's groups), and a mark
for the expert exchanges' way back.

The planner's traffic ledger names each collective's group by its mesh dimension (``ParallelDims.group_labels``); a
group that no mesh holds is labelled here by whoever makes it, so that its traffic is priced on its own ranks
instead of being lumped with other unknown groups. The dispatchers run their exchanges back (the experts' outputs
to the tokens' ranks) inside ``way_back()``, so that selective AC 'exchange' can tell them from the dispatch: the
same op on the same group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

_LABELS: dict[str, str] = {}


def label_group(group: dist.ProcessGroup, label: str) -> None:
    """Name ``group``'s traffic ``label`` in the planner's ledger."""
    _LABELS[group.group_name] = label


def extra_group_labels() -> dict[str, str]:
    """Process-group name -> label, for the groups labelled with ``label_group``."""
    return dict(_LABELS)


_way_back = [0]


@contextlib.contextmanager
def way_back() -> Iterator[None]:
    """Inside: the expert exchange that runs is a way back (outputs to the tokens' ranks), not a dispatch."""
    _way_back[0] += 1
    try:
        yield
    finally:
        _way_back[0] -= 1


def on_way_back() -> bool:
    """Whether an expert exchange's way back is running (``way_back``)."""
    return _way_back[0] > 0
