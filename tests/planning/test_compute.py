"""The dry run's per-op work: the bytes a memory-bound kernel moves, counted as it reads and writes them.

The cost model prices these bytes at the device's bandwidth, so an op whose writes go uncounted looks
cheaper than it runs: fused AdamW reads a parameter, its gradient and two moments and writes back three
of them, 28 bytes per float32 parameter, not the 16 its arguments hold.
"""

from __future__ import annotations

from collections import Counter

import torch

from torchtitan.compat import TorchDispatchMode, op_name
from torchtitan.planning.compute import moved_bytes


class _BytesByOp(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.bytes: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.bytes[op_name(func)] += moved_bytes(func, args, kwargs, out)
        return out


def _params(*numels: int) -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(torch.randn(n)) for n in numels]
    for p in params:
        p.grad = torch.randn_like(p)
    return params


def test_fused_adamw_reads_four_tensors_and_writes_three_per_parameter():
    params = _params(1000, 24)
    optimizer = torch.optim.AdamW(params, lr=1e-3, fused=True)
    optimizer.step()  # the moments and step counters exist now
    with _BytesByOp() as counted:
        optimizer.step()
    elements = 1000 + 24
    steps = 4 * len(params)  # the float32 step counters, read
    assert counted.bytes["_fused_adamw_"] == 4 * (4 + 3) * elements + steps


def test_in_place_updates_and_out_buffers_count_each_tensor_once_each_way():
    a, b, c = torch.randn(100), torch.randn(100), torch.empty(100)
    grads = [p.grad for p in _params(300, 20)]
    with _BytesByOp() as counted:
        torch._foreach_mul_(grads, 0.5)  # returns nothing: read and written back
        torch._foreach_norm(grads)  # read; 2 scalars written
        torch.add(a, b, out=c)  # c is only written, and returned
        a.add_(b)  # returns a
    assert counted.bytes["_foreach_mul_"] == 2 * 4 * 320
    assert counted.bytes["_foreach_norm"] == 4 * 320 + 2 * 4
    assert counted.bytes["add"] == 3 * 4 * 100
    assert counted.bytes["add_"] == 3 * 4 * 100
