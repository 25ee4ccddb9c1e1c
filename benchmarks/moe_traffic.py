"""Expert-parallel all-to-all bytes per step, measured on real gloo ranks, against the formula.

    python benchmarks/moe_traffic.py [--ep 2 4] [--tokens 1024]

For each expert-parallel degree it starts that many processes (gloo, one thread each), builds one
``MoE`` layer (``torchtitan/models/moe``) and shards its experts with ``apply_expert_parallel``,
then runs a forward and backward on ``--tokens`` tokens per rank, once plainly and once under
activation checkpointing. While they run, a dispatch mode counts each functional all-to-all, so
that each call adds the bytes its splits send to other ranks (rows and token counts, forward and
backward). The table compares that measurement, per rank, with
``torchtitan.models.moe.traffic.exact_all_to_all_bytes`` (the count this routing implies, from
every rank's tokens per expert) and ``all_to_all_bytes`` (the expectation under uniform routing).

Routing: "random" is the router as initialised (close to uniform, not exactly); "skewed" biases
the router (the auxiliary-loss-free bias) so that most pairs go to the first rank's experts.
The experts' hidden width does not enter the traffic, so it stays small; ``dim`` is the model width.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from torchtitan.models.moe.traffic import all_to_all_bytes, exact_all_to_all_bytes  # noqa: E402

# (label, dim, experts, top_k, dtype, routing)
CASES = [
    ("debug width", 256, 8, 2, torch.float32, "random"),
    ("debug width, bf16", 256, 8, 2, torch.bfloat16, "random"),
    ("debug width, skewed", 256, 8, 2, torch.float32, "skewed"),
    ("Mixtral width", 4096, 8, 2, torch.bfloat16, "random"),
    ("Qwen3-30B-A3B-like", 2048, 32, 8, torch.bfloat16, "random"),
]
HIDDEN = 32  # experts' width: not in the traffic


class AllToAllCounter:
    """Bytes this rank's ``all_to_all_single`` calls send to other ranks: ``rows`` (split calls) and ``counts``."""

    def __init__(self) -> None:
        self.rows = 0
        self.counts = 0
        self.calls = 0

    def add(self, tensor: torch.Tensor, in_splits: list[int], group: Any) -> None:
        me = dist.get_rank(group)
        row_bytes = tensor[0].numel() * tensor.element_size() if tensor.dim() > 1 else tensor.element_size()
        sent = sum(s for r, s in enumerate(in_splits) if r != me) * row_bytes
        self.calls += 1
        if tensor.dim() == 1:  # the dispatcher's count exchange: equal splits of the [E] counts
            self.counts += sent
        else:
            self.rows += sent


class _CountingMode(TorchDispatchMode):
    """Adds each functional all-to-all that runs (what ``dispatch.py`` calls) to ``counter``. A dispatch mode
    sees only the calls that communicate: one whose output selective activation checkpointing kept is
    answered from the saved tensor, under the checkpoint's own mode, and never reaches this one."""

    def __init__(self, counter: AllToAllCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func is torch.ops._c10d_functional.all_to_all_single.default:
            tensor, _, in_splits, group_name = args
            self.counter.add(tensor, list(in_splits), _resolve_process_group(group_name))
        return func(*args, **(kwargs or {}))


@contextmanager
def counting_all_to_all() -> Iterator[AllToAllCounter]:
    """Count the all-to-alls (calls and bytes sent) that run while the block runs, forward and backward."""
    counter = AllToAllCounter()
    with _CountingMode(counter):
        yield counter


def build_moe(dim: int, num_experts: int, top_k: int, dtype: torch.dtype, skewed: bool, seed: int = 0):
    """One MoE layer, experts sharded over the whole world (a 1-D ``ep`` mesh), initialised layout-free."""
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan.distributed.layout_init import init_params_layout_invariant
    from torchtitan.models.moe import MoE, MoEArgs
    from torchtitan.models.moe.parallel import apply_expert_parallel

    args = MoEArgs(dim=dim, hidden_dim=HIDDEN, num_experts=num_experts, top_k=top_k, norm_topk_prob=True,
                   load_balance_bias=skewed)
    with torch.device("meta"):
        moe = MoE(args)
    apply_expert_parallel(moe, init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("ep",)))
    moe.to_empty(device="cpu")
    moe.init_buffers()
    init_params_layout_invariant(moe, seed)
    bias = moe.router.expert_bias
    if skewed and bias is not None:  # most pairs to the first rank's experts
        local = num_experts // dist.get_world_size()
        bias.copy_(torch.tensor([0.05 if e < local else -0.05 for e in range(num_experts)]))
    return moe.to(dtype)


def measure(tokens: int, dim: int, num_experts: int, top_k: int, dtype: torch.dtype, skewed: bool,
            recompute: bool) -> dict[str, Any]:
    """On each rank of the current world: measured bytes, the exact count of the routing, the expectation."""
    from torch.utils.checkpoint import checkpoint

    rank, ep = dist.get_rank(), dist.get_world_size()
    moe = build_moe(dim, num_experts, top_k, dtype, skewed)
    x = torch.randn(tokens, dim, generator=torch.Generator().manual_seed(1 + rank)).to(dtype).requires_grad_(True)
    with counting_all_to_all() as counter:
        y = checkpoint(moe, x, use_reentrant=False) if recompute else moe(x)
        y.float().square().mean().backward()
    mine = moe.tokens_per_expert.clone()
    everyone = [torch.empty_like(mine) for _ in range(ep)]
    dist.all_gather(everyone, mine)
    counts = [t.tolist() for t in everyone]
    size = torch.tensor([], dtype=dtype).element_size()
    return dict(measured=counter.rows + counter.counts, rows=counter.rows, counts=counter.counts, calls=counter.calls,
                exact=exact_all_to_all_bytes(counts, rank, dim, size, recompute),
                uniform=all_to_all_bytes(tokens, top_k, dim, ep, size, num_experts, recompute),
                remote_pairs=sum(mine.tolist()) - sum(mine.view(ep, -1)[rank].tolist()))


def _rank(rank: int, world: int, port: int, tokens: int, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out = []
        for label, dim, experts, top_k, dtype, routing in CASES:
            for recompute in (False, True):
                row = measure(tokens, dim, experts, top_k, dtype, routing == "skewed", recompute)
                out.append(dict(label=label, dim=dim, experts=experts, top_k=top_k, dtype=str(dtype)[6:],
                                routing=routing, recompute=recompute, **row))
        results.put((rank, out))
    finally:
        dist.destroy_process_group()


def run_world(world: int, tokens: int) -> list[list[dict[str, Any]]]:
    """Every case on ``world`` spawned ranks; per rank, its rows."""
    import torch.multiprocessing as mp

    from torchtitan.distributed.lifecycle import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, tokens, results)) for r in range(world)]
    for p in procs:
        p.start()
    by_rank = dict(results.get(timeout=900) for _ in procs)
    for p in procs:
        p.join()
    return [by_rank[r] for r in range(world)]


def report(world: int, tokens: int, by_rank: list[list[dict[str, Any]]]) -> None:
    print(f"\nEP {world}, {tokens} tokens per rank. MiB each rank sends to the others per forward + backward of one "
          "layer: measured on ranks 0.., whether each equals the exact count, the uniform expectation, the mean "
          "and the largest rank over it; the share of each rank's pairs dispatched to another rank; count bytes")
    print(f"{'case':>22} {'D':>5} {'E':>3} {'k':>2} {'dtype':>8} {'AC':>3} {'measured':>28} {'=exact':>6} "
          f"{'uniform':>8} {'mean/u':>6} {'max/u':>6} {'remote share':>24} {'counts':>6}")
    for i, row in enumerate(by_rank[0]):
        rows = [r[i] for r in by_rank]
        measured = [r["measured"] for r in rows]
        exact = all(r["measured"] == r["exact"] for r in rows)
        share = " ".join(f"{r['remote_pairs'] / (tokens * row['top_k']):.2f}" for r in rows)
        print(f"{row['label']:>22} {row['dim']:5d} {row['experts']:3d} {row['top_k']:2d} {row['dtype']:>8} "
              f"{'yes' if row['recompute'] else 'no':>3} {' '.join(f'{m / 2**20:.3f}' for m in measured):>28} "
              f"{'yes' if exact else 'NO':>6} {row['uniform'] / 2**20:8.3f} "
              f"{sum(measured) / world / row['uniform']:6.3f} {max(measured) / row['uniform']:6.3f} {share:>24} "
              f"{row['counts']:6d}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ep", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tokens", type=int, default=1024)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for world in args.ep:
        report(world, args.tokens, run_world(world, args.tokens))


if __name__ == "__main__":
    main()
