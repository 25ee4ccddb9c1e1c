"""AdamW step time on CPU: the fused kernel the trainer now picks against foreach.

    python benchmarks/optimizer_step.py [--flavor debugmodel] [--rounds 5] [--steps 10]

One process, one thread, the whole model's parameters (float32) with random gradients.
The two implementations take turns round by round, so a change in the machine's load
hits both alike; the script prints each round's milliseconds per step and the ratio of
the medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from torchtitan.models.llama3 import Transformer, llama3_flavors


def step_ms(params: list[torch.nn.Parameter], impl: str, steps: int) -> float:
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, **{impl: True})
    for _ in range(3):  # warm-up: the state is created on the first step
        optimizer.step()
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    params = list(Transformer(llama3_flavors[args.flavor]).parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    times: dict[str, list[float]] = {"foreach": [], "fused": []}
    for _ in range(args.rounds):
        for impl in times:
            times[impl].append(step_ms(params, impl, args.steps))
    n = sum(p.numel() for p in params)
    print(f"{args.flavor}: {n:,} parameters, torch {torch.__version__}")
    for impl, ms in times.items():
        print(f"{impl:>8}: median {statistics.median(ms):.1f} ms/step  (rounds: {', '.join(f'{x:.1f}' for x in ms)})")
    print(f"fused / foreach: {statistics.median(times['fused']) / statistics.median(times['foreach']):.2f}")


if __name__ == "__main__":
    main()
