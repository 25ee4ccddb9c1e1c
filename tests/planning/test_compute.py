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
from torchtitan.planning.sink_attention import sink_attention_as_on_gpu


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


def test_an_in_place_index_add_and_a_gather_move_the_indexed_rows_only():
    """The two-hop dispatch's sums add a few rows at a time into a large float32 buffer: priced as the source, the
    index, and the rows it updates (read and written), not the whole buffer each time; a gather of a few rows from a
    large tensor reads those rows."""
    total, rows = torch.zeros(1000, 8), torch.randn(10, 8, dtype=torch.bfloat16)
    index = torch.arange(10) * 7
    with _BytesByOp() as counted:
        total.index_add_(0, index, rows.float())
        total.index_select(0, index)
    assert counted.bytes["index_add_"] == 10 * 8 + 10 * 8 * 4 + 2 * 10 * 8 * 4
    assert counted.bytes["index_select"] == 10 * 8 + 2 * 10 * 8 * 4  # a gather reads only the rows it selects


class _Ledger(TorchDispatchMode):
    """Each op's work as the dry run's ``ComputeLedger`` records it, summed, and the largest tensor made."""

    def __init__(self) -> None:
        super().__init__()
        self.work = PhaseWork()
        self.largest = 0
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        w = op_work(func, args, kwargs, out)
        if w is not None:
            self.work.add(w)
        for t in out if isinstance(out, tuple) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
                self.shapes.add(tuple(t.shape))
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


def _sink_inputs(batch: int, heads: int, kv_heads: int, seq: int, head: int) -> tuple[torch.Tensor, ...]:
    """GPT-OSS's attention inputs: grouped K/V heads in bf16, float32 sinks [heads] (a parameter)."""
    q = torch.randn(batch, heads, seq, head, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(batch, kv_heads, seq, head, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    return q, k, v, torch.nn.Parameter(torch.randn(heads))


def _window_pairs(seq: int, window: int) -> int:
    return sum(min(i + 1, window) for i in range(seq))  # row i keeps its own key and up to window - 1 before it


def test_sink_attention_is_priced_as_flex_attention_over_the_pairs_its_window_keeps():
    """GPT-OSS's whole-sequence attention in the dry run: one FlexAttention op, no score matrix; a full layer's
    FLOPs over the whole matrix flagged causal (the cost model halves them), a windowed layer's over the pairs
    its window keeps (about L x W), not halved again."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from torchtitan.models.attention import backends

    b, h, s, d, window = 1, 4, 256, 32, 16
    with FakeTensorMode(), sink_attention_as_on_gpu():
        q, k, v, sinks = _sink_inputs(b, h, 2, s, d)
        with _Ledger() as full:
            backends.local_sink_attention(q, k, v, None, sinks, None)
        with _Ledger() as windowed:
            backends.local_sink_attention(q, k, v, None, sinks, window)
    per_pair = 2 * b * h * (d + d)  # the scores' product and the weighted sum's
    assert full.work.attention_flops == full.work.causal_attention_flops == per_pair * s * s
    assert windowed.work.attention_flops == per_pair * _window_pairs(s, window)
    assert windowed.work.causal_attention_flops == 0
    assert windowed.work.attention_flops < full.work.attention_flops / 2
    for ledger in (full, windowed):
        assert ledger.largest < b * h * s * s * 2 and ledger.work.matmul_flops == 0  # no [s, s] scores


def test_sink_attention_grads_reach_the_sinks_through_a_recompute_and_per_op_policies_keep_it():
    """The sinks are parameters: their gradient, and q's, k's and v's, come through a checkpointed block's
    recompute; the 'op' and 'moe' policies keep the attention's output as a GPU's FlexAttention's (no recompute)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.checkpoint import checkpoint

    from torchtitan.distributed.activation_checkpoint import _every_second_linear_contexts, _moe_contexts
    from torchtitan.models.attention import backends

    b, h, s, d, window = 1, 4, 128, 32, 16
    one_pass = 2 * b * h * (d + d) * _window_pairs(s, window)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
        return backends.local_sink_attention(q, k, v, None, sinks, window)

    for policy, passes in ((None, 4), (_every_second_linear_contexts, 3), (_moe_contexts, 3)):
        options = {} if policy is None else {"context_fn": policy}
        with FakeTensorMode(), sink_attention_as_on_gpu():
            inputs = _sink_inputs(b, h, 2, s, d)
            with _Ledger() as ledger:
                checkpoint(attend, *inputs, use_reentrant=False, **options).float().sum().backward()
            for t in inputs:
                assert t.grad is not None and t.grad.shape == t.shape
        # Forward, its recompute unless kept, and a backward of twice the work.
        assert ledger.work.attention_flops == passes * one_pass, policy


def test_a_gpt_oss_step_makes_no_score_sized_tensor_in_the_dry_run():
    """The debug GPT-OSS (a windowed and a full layer) forward and backward as the dry run runs them: no
    [B, H, L, L] scores, no [B, 1, L, L] mask, nothing with the sink column [.., L, L + 1]."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from torchtitan.compat.kernels import grouped_mm_as_on
    from torchtitan.models import get_model_spec
    from torchtitan.models.gpt_oss.args import gpt_oss_flavors
    from torchtitan.planning.moe import GPU_GROUPED_MM_DTYPES, assume_routing

    seq = 40  # no dim of the debug model's
    args = gpt_oss_flavors["debugmodel"].with_first_layers(2)
    assert args.window(0) is not None and args.window(1) is None
    # As the dry run: fake tensors, the experts' kernel chosen as a GPU's.
    with FakeTensorMode(allow_non_fake_inputs=True), grouped_mm_as_on(GPU_GROUPED_MM_DTYPES), \
            sink_attention_as_on_gpu():
        model = get_model_spec("gpt_oss").build(args)
        assume_routing([model])  # as the dry run: fake tensors hold no token counts
        with _Ledger() as ledger:
            model(torch.randint(0, args.vocab_size, (1, seq))).float().sum().backward()
        assert model.layers["0"].attention.sinks.grad is not None
    assert ledger.shapes and not [shape for shape in ledger.shapes if shape[-2:] in ((seq, seq), (seq, seq + 1))]
    assert ledger.work.attention_flops > 0
