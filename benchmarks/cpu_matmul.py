"""Float32 matrix products of a linear layer on CPU: ATen's default (MKL on x86) against oneDNN.

    python benchmarks/cpu_matmul.py [--tokens 2048] [--rounds 5]

One process, one thread (as each rank of a CPU run has). For each weight shape of the debug
model (dim 256, FFN 768, K/V 128, vocabulary 2048) it times the three products of a linear
layer's step, forward ``x W^T``, ``dL/dx = g W`` and ``dL/dW = g^T x``, once as ``F.linear``
and its autograd would run them and once as ``training.cpu_matmul = "onednn"`` runs them
(``torchtitan/ops/cpu_kernels.py``). The two take turns round by round; the script prints
GFLOP/s (medians) and the ratio, and the largest gap of each against float64.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from common import machine_description

from torchtitan.ops.cpu_kernels import times_transposed

SHAPES = [(256, 256), (128, 256), (768, 256), (256, 768), (2048, 256)]  # (out, in)


def _seconds(fn: Callable[[], torch.Tensor], repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def products(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> dict[str, dict[str, Callable]]:
    return {
        "aten": {"forward": lambda: x @ w.t(), "dL/dx": lambda: g @ w, "dL/dW": lambda: g.t() @ x},
        "onednn": {"forward": lambda: times_transposed(x, w), "dL/dx": lambda: times_transposed(g, w.t()),
                   "dL/dW": lambda: times_transposed(g.t().contiguous(), x.t())},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048, help="rows of x: batch x sequence per rank")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"{machine_description()}; {args.tokens} tokens; GFLOP/s, median of {args.rounds} rounds")
    print(f"{'W (out x in)':>13} {'product':>8} {'aten':>7} {'onednn':>7} {'ratio':>6} "
          f"{'gap aten':>9} {'gap onednn':>10}")
    for out_f, in_f in SHAPES:
        x, w, g = torch.randn(args.tokens, in_f), torch.randn(out_f, in_f), torch.randn(args.tokens, out_f)
        exact = {"forward": x.double() @ w.double().t(), "dL/dx": g.double() @ w.double(),
                 "dL/dW": g.double().t() @ x.double()}
        fns = products(x, w, g)
        flop = 2 * args.tokens * in_f * out_f
        for name in exact:
            rates: dict[str, list[float]] = {"aten": [], "onednn": []}
            for _ in range(args.rounds):
                for impl in rates:
                    rates[impl].append(flop / _seconds(fns[impl][name], args.repeats) / 1e9)
            gaps = {impl: (fns[impl][name]().double() - exact[name]).abs().max().item() for impl in rates}
            a, o = statistics.median(rates["aten"]), statistics.median(rates["onednn"])
            print(f"{f'{out_f} x {in_f}':>13} {name:>8} {a:7.1f} {o:7.1f} {o / a:6.2f} {gaps['aten']:9.1e} "
                  f"{gaps['onednn']:10.1e}")


if __name__ == "__main__":
    main()
