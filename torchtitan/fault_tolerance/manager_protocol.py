"""The part of torchft's ``Manager`` this project calls, as a type.

torchft is imported lazily (only fault-tolerant runs need it), so the code that holds a manager
types it by this protocol instead of importing torchft at module level.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Protocol

import torch
from torch.distributed.distributed_c10d import ReduceOp, Work


class FTManager(Protocol):
    """A replica group's torchft manager: quorum, commit vote, cross-group all-reduce and step counters."""

    # ReduceOp.SUM and friends are typed as ReduceOp.RedOpType in torch's stubs.
    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = ...,
                  reduce_op: ReduceOp | ReduceOp.RedOpType = ...) -> Work: ...

    def current_step(self) -> int: ...

    def errored(self) -> object | None: ...

    def num_participants(self) -> int: ...

    def participating_rank(self) -> int | None: ...

    def start_quorum(self, allow_heal: bool = ..., shrink_only: bool = ...,
                     timeout: timedelta | None = ...) -> None: ...

    def should_commit(self, timeout: timedelta | None = ...) -> bool: ...

    def state_dict(self) -> dict[str, int]: ...

    def load_state_dict(self, state_dict: dict[str, int]) -> None: ...

    def shutdown(self, wait: bool = ...) -> None: ...
