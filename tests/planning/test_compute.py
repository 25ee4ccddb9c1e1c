"""The dry run's per-op work: the bytes a memory-bound kernel moves, counted as it reads and writes them.

The cost model prices these bytes at the device's bandwidth, so an op whose writes go uncounted looks
cheaper than it runs: fused AdamW reads a parameter, its gradient and two moments and writes back three
of them, 28 bytes per float32 parameter, not the 16 its arguments hold.
"""

from __future__ import annotations

from collections import Counter

import torch

from torchtitan.compat import TorchDispatchMode, op_name
from torchtitan.planning.compute import PhaseWork, moved_bytes, op_work
from torchtitan.planning.fused_attention import fused_attention_as_on_gpu


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


class _Ledger(TorchDispatchMode):
    """Each op's work as the dry run's ``ComputeLedger`` records it, summed, and the largest tensor made."""

    def __init__(self) -> None:
        super().__init__()
        self.work = PhaseWork()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        w = op_work(func, args, kwargs, out)
        if w is not None:
            self.work.add(w)
        for t in out if isinstance(out, tuple) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def test_attention_with_its_own_value_head_is_priced_as_the_fused_kernel_through_a_recompute():
    """MLA's attention (query head 192, value head 128) in the dry run: one fused op forward and backward
    (the recompute of a checkpointed forward included), FLOPs of both products at their own head sizes, no
    score matrix made, and no other kernel's bytes; a call with equal heads keeps torch's own op."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.checkpoint import checkpoint

    b, h, s, d, dv = 1, 4, 256, 192, 128
    with FakeTensorMode(), fused_attention_as_on_gpu():
        q, k = (torch.randn(b, h, s, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        v = torch.randn(b, h, s, dv, dtype=torch.bfloat16, requires_grad=True)
        with _Ledger() as ledger:
            out = checkpoint(lambda *t: torch.nn.functional.scaled_dot_product_attention(*t, is_causal=True),
                             q, k, v, use_reentrant=False)
            assert out.shape == (b, h, s, dv)
            out.sum().backward()
        assert q.grad is not None and v.grad is not None and q.grad.shape == q.shape and v.grad.shape == v.shape
    one_pass = 2 * b * h * s * s * (d + dv)
    assert ledger.work.attention_flops == 4 * one_pass  # forward, its recompute, and a backward of twice the work
    assert ledger.work.causal_attention_flops == ledger.work.attention_flops
    assert ledger.largest < b * h * s * s * 2  # no [s, s] scores, not even in bf16
    assert ledger.work.matmul_flops == 0

    # Under a per-op policy the output is kept, as the fused kernel's would be: no recompute.
    from torchtitan.distributed.activation_checkpoint import _moe_contexts

    with FakeTensorMode(), fused_attention_as_on_gpu():
        q, k = (torch.randn(b, h, s, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        v = torch.randn(b, h, s, dv, dtype=torch.bfloat16, requires_grad=True)
        with _Ledger() as kept:
            out = checkpoint(lambda *t: torch.nn.functional.scaled_dot_product_attention(*t, is_causal=True),
                             q, k, v, use_reentrant=False, context_fn=_moe_contexts)
            out.sum().backward()
    assert kept.work.attention_flops == 3 * one_pass

    # Grouped K/V heads are read in place: no repeated copy, gradients of their own shape, the query heads' work.
    with FakeTensorMode(), fused_attention_as_on_gpu():
        q = torch.randn(b, h, s, d, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(b, 1, s, d, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(b, 1, s, dv, dtype=torch.bfloat16, requires_grad=True)
        with _Ledger() as grouped:
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()
        assert k.grad is not None and k.grad.shape == k.shape
    assert grouped.work.attention_flops == 3 * one_pass and grouped.work.memory_bytes < 4 * b * h * s * d * 2

    with FakeTensorMode(), fused_attention_as_on_gpu(), _Ledger() as same_heads:
        q, k, v = (torch.randn(b, h, s, d, dtype=torch.bfloat16) for _ in range(3))
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert same_heads.work.attention_flops == 2 * b * h * s * s * (2 * d)


def test_a_collectives_wait_moves_nothing():
    """A functional collective's wait is no kernel: its buffer's bytes were counted once, at the collective."""
    assert op_work(torch.ops._c10d_functional.wait_tensor.default, (torch.ones(4),), {}, torch.ones(4)) is None
    add = op_work(torch.ops.aten.add.Tensor, (torch.ones(4), torch.ones(4)), {}, torch.ones(4))
    assert add is not None and add.memory_bytes == 48
