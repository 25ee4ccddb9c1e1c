"""The replica check: every ``replica_check_freq`` committed steps the live groups compare a
fingerprint of their weights and optimizer state, and stop on a mismatch.

Silent data corruption, or a heal that went wrong, would otherwise train on unnoticed: the
groups average their gradients, not their weights, so nothing else ever compares them.
The fingerprint is computed on the device, from the raw bits of this rank's shards (any
single flipped bit changes it); group rank ``r`` compares with group rank ``r`` of every
other group, which holds the same shards.
"""

from __future__ import annotations

import torch
from torch.distributed.distributed_c10d import ReduceOp
from torch.distributed.tensor import DTensor

from torchtitan.fault_tolerance.manager_protocol import FTManager

_WORDS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@torch.no_grad()
def fingerprint(tensors: list[torch.Tensor]) -> int:
    """A 64-bit fingerprint of the tensors' bits: wrap-around sums of their words, weighted by position."""
    total: torch.Tensor | None = None
    for i, t in enumerate(tensors):
        local = (t.to_local() if isinstance(t, DTensor) else t).detach().contiguous().reshape(-1)
        if local.numel() == 0:
            continue
        words = local.view(_WORDS[local.element_size()]).to(torch.int64)
        positions = torch.arange(1, words.numel() + 1, dtype=torch.int64, device=words.device)
        term = (words * positions).sum() * (2 * i + 1)
        total = term if total is None else total + term
    return 0 if total is None else int(total)


def model_and_optimizer_tensors(model_parts: list[torch.nn.Module], optimizer: torch.optim.Optimizer
                                ) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = []
    for part in model_parts:
        for p in part.parameters():
            tensors.append(p)
            tensors.extend(value for _, value in sorted(optimizer.state[p].items()))
    return tensors


def check_replicas(manager: FTManager, replica_id: int, num_replica_groups: int, value: int, step: int) -> None:
    """Compare ``value`` with the other live groups' (same group rank); raise naming the step and the groups."""
    table = torch.zeros((num_replica_groups, 2), dtype=torch.int64)
    table[replica_id] = torch.tensor([value, 1])
    # Summed: each group fills its own row. A group outside this quorum (healing) sends zeros.
    manager.allreduce(table, reduce_op=ReduceOp.SUM).wait()
    if manager.errored():
        return  # a group died in between: this step's comparison is lost, the next one will run
    present = {g: int(table[g, 0]) for g in range(num_replica_groups) if int(table[g, 1]) == 1}
    if len(set(present.values())) > 1:
        detail = ", ".join(f"group {g}: {fp & 0xFFFFFFFFFFFFFFFF:016x}" for g, fp in sorted(present.items()))
        raise RuntimeError(
            f"replica check failed at step {step}: the replica groups hold different weights or optimizer state "
            f"({detail}); stopping, since silent data corruption or a bad heal must not train on"
        )
