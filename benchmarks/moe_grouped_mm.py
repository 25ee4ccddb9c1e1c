"""MoE experts on CPU: ``torch._grouped_mm`` against the exact per-expert loop, forward and backward.

    python benchmarks/moe_grouped_mm.py [--rounds 5] [--repeats 3] [--device cuda] [--rows N]

One process, one thread (as each rank of a CPU run has). For a few expert shapes it times a
``GroupedExperts`` (``torchtitan/models/moe/experts.py``) forward plus backward on tokens
already grouped by expert, once through ``torch._grouped_mm`` and once through the per-expert
loop (``use_grouped_mm=False``), taking turns round by round, and prints the median time and
the largest difference of the two outputs (0: bit-identical). Routing is uneven: expert
``e`` gets a share proportional to ``e + 1``, and one expert gets no token.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import machine_description

from torchtitan.models.moe.experts import GroupedExperts

# (label, rows = tokens x top-k, dim, expert hidden, experts, dtype)
# On CUDA: bf16, the expert shapes of the MoE models the project trains (one layer's routed tokens at
# seq 4096 x top-k); the CUTLASS grouped GEMM against the loop of one GEMM per expert.
CUDA_SHAPES = [
    ("Qwen3-30B-A3B layer", 4096 * 8, 2048, 768, 128, torch.bfloat16),
    ("DeepSeek-V3-like layer", 4096 * 8, 7168, 2048, 32, torch.bfloat16),
    ("Mixtral-like layer", 4096 * 2, 4096, 14336, 8, torch.bfloat16),
]
SHAPES = [
    ("debug MoE", 2048 * 2, 256, 256, 8, torch.float32),
    ("Qwen3-MoE-like, narrow", 1024 * 8, 512, 192, 32, torch.float32),
    ("wide experts", 1024 * 2, 512, 1024, 8, torch.float32),
    ("debug MoE, bf16", 2048 * 2, 256, 256, 8, torch.bfloat16),
]


def uneven_counts(rows: int, experts: int) -> torch.Tensor:
    """Rows per expert: expert e's share grows with e; expert 1 gets none."""
    share = torch.arange(1, experts + 1, dtype=torch.float64)
    share[1] = 0
    counts = (share / share.sum() * rows).floor().long()
    counts[-1] += rows - counts.sum()
    return counts


def step_seconds(experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor, grad: torch.Tensor,
                 repeats: int) -> float:
    def once() -> torch.Tensor:
        experts.zero_grad(set_to_none=True)
        xi = x.detach().requires_grad_(True)
        y = experts(xi, counts)
        y.backward(grad)
        return y

    once()
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        once()
    sync()  # CUDA queues the kernels: the clock stops when they are done
    return (time.perf_counter() - start) / repeats


def compare(rows: int, dim: int, hidden: int, num_experts: int, dtype: torch.dtype, rounds: int,
            repeats: int, device: str = "cpu") -> tuple[float, float, float]:
    """(median ms grouped, median ms loop, max |difference| of the outputs)."""
    torch.manual_seed(0)
    pair = {flag: GroupedExperts(dim, hidden, num_experts, use_grouped_mm=flag).to(device, dtype)
            for flag in (True, False)}
    for name in ("w1", "w2", "w3"):
        value = torch.randn_like(getattr(pair[True], name)) * 0.02
        for experts in pair.values():
            getattr(experts, name).data.copy_(value)
    x, grad = torch.randn(rows, dim, dtype=dtype, device=device), torch.randn(rows, dim, dtype=dtype, device=device)
    counts = uneven_counts(rows, num_experts).to(device)
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(rounds):
        for flag, experts in pair.items():
            times[flag].append(step_seconds(experts, x, counts, grad, repeats) * 1e3)
    with torch.no_grad():
        gap = (pair[True](x, counts) - pair[False](x, counts)).abs().max().item()
    return statistics.median(times[True]), statistics.median(times[False]), gap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--rows", type=int, default=None, help="tokens of every shape (default: each shape's own)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    where = torch.cuda.get_device_name(0) + f", torch {torch.__version__}" if args.device == "cuda" \
        else machine_description()
    print(f"{where}; forward + backward, ms, median of {args.rounds} rounds")
    print(f"{'shape':>24} {'rows':>6} {'D':>5} {'F':>5} {'E':>3} {'dtype':>9} {'grouped':>8} {'loop':>8} "
          f"{'loop/grouped':>12} {'max gap':>8}")
    for label, rows, dim, hidden, num_experts, dtype in (CUDA_SHAPES if args.device == "cuda" else SHAPES):
        rows = args.rows or rows
        grouped, loop, gap = compare(rows, dim, hidden, num_experts, dtype, args.rounds, args.repeats, args.device)
        print(f"{label:>24} {rows:6d} {dim:5d} {hidden:5d} {num_experts:3d} {str(dtype)[6:]:>9} {grouped:8.1f} "
              f"{loop:8.1f} {loop / grouped:12.2f} {gap:8.1e}")


if __name__ == "__main__":
    main()
