"""Cost of document-masked attention: a ``block_causal`` training step against a ``causal`` one, on CPU.

    python benchmarks/document_mask.py                         # 8 x 256 and 8 x 2048 tokens per rank, FSDP 2
    python benchmarks/document_mask.py --shapes 8x2048 --steps 6
    python benchmarks/document_mask.py --kernels                # attention alone: the CPU candidates

Both trainers (``--model.attn_mask_type=block_causal`` and ``causal``, otherwise the same
debug model, embedded corpus, layout and seed) live in the same two processes and take
turns step by step in an ABBA order, so a change in the machine's load hits both alike.
Before each step every rank waits at a barrier; a step's time is the slowest rank's.
Printed: the median step time of each, their ratio and the median of the paired ratios.
Targets (issue 35): ratio <= 1.1 at 8 x 256, < 1 at 8 x 2048.

``--kernels`` times one attention call (forward and backward, the debug model's heads) of
each CPU candidate on the embedded corpus's windows: causal SDPA (the reference), SDPA with
the dense document mask, and one causal SDPA per document (what the trainer runs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    LAYOUTS,
    benchmark_parser,
    build_trainer,
    end_worker,
    load_average,
    machine_description,
    run_workers,
    wall_clock,
)

MASKS = ("block_causal", "causal")


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    total = args.warmup + args.steps
    batch, seq = args.shape.split("x")
    common = [f"--training.steps={total}", f"--training.batch_size={batch}", f"--training.seq_len={seq}",
              "--metrics.log_freq=1000", "--metrics.enable_tensorboard=false", *args.overrides]
    trainers = {mask: build_trainer(f"{args.dump}/{mask}", [*common, f"--model.attn_mask_type={mask}"])
                for mask in MASKS}
    for t in trainers.values():
        t.step_strategy.begin(t.step, t.grad_accum)  # what Trainer.train starts; _run_step reads its batches then
    times: dict[str, list[float]] = {mask: [] for mask in MASKS}
    for i in range(total):
        for mask in (MASKS if i % 2 == 0 else MASKS[::-1]):  # ABBA
            dist.barrier()
            start = wall_clock()
            trainers[mask]._run_step()
            times[mask].append(wall_clock() - start)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, times)
    if dist.get_rank() == 0:
        slowest = {m: [max(r[m][i] for r in everyone) for i in range(total)][args.warmup:] for m in MASKS}
        with open(args.result, "w") as f:
            json.dump({"times": slowest, "load_average": load_average()}, f)
    for trainer in trainers.values():
        trainer.close()
    end_worker(trainers["causal"])


def kernels(shapes: str, reps: int) -> None:
    """Attention alone, one process: the candidates on windows of the embedded corpus, interleaved."""
    import torch
    import torch.nn.functional as F

    from torchtitan.datasets import DataLayout, build_dataloader, build_tokenizer
    from torchtitan.models.attention import build_document_mask, dense_mask, document_causal_mask_mod
    from torchtitan.models.llama3 import llama3_flavors

    args = llama3_flavors["debugmodel"]
    tokenizer = build_tokenizer("torchtitan/datasets/assets/tokenizer.model")
    print(f"{'shape':>8s} {'docs':>5s} {'causal ms':>10s} {'dense x':>8s} {'per-document x':>15s}")
    for shape in shapes.split(","):
        batch, seq = (int(n) for n in shape.split("x"))
        loader = build_dataloader(dataset_name="embedded", dataset_path=None, tokenizer=tokenizer,
                                  layout=DataLayout(seq, batch, 0, 1), positions=True, prefetch=0)
        _, _, positions = next(iter(loader))
        mask = build_document_mask(positions)
        allowed = dense_mask(document_causal_mask_mod(mask.docs), batch, seq, seq, positions.device)
        torch.manual_seed(0)
        q, k, v = (torch.randn(batch, seq, n, args.head_dim).transpose(1, 2).requires_grad_()
                   for n in (args.n_heads, args.n_kv_heads, args.n_kv_heads))
        candidates = {
            "causal": lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
            "dense": lambda q=q, k=k, v=v, allowed=allowed: F.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed, enable_gqa=True),
            "per-document": lambda q=q, k=k, v=v, mask=mask: per_document(q, k, v, mask.segment_lengths()),
        }
        times: dict[str, list[float]] = {name: [] for name in candidates}
        for _ in range(reps + 1):
            for name, fn in candidates.items():
                start = wall_clock()
                fn().sum().backward()
                times[name].append(wall_clock() - start)
        med = {name: statistics.median(t[1:]) for name, t in times.items()}
        print(f"{shape:>8s} {len(mask.segment_lengths()):5d} {med['causal'] * 1e3:10.1f} "
              f"{med['dense'] / med['causal']:8.2f} {med['per-document'] / med['causal']:15.2f}", flush=True)


def per_document(q, k, v, segments):
    from torchtitan.models.attention import per_document_sdpa

    return per_document_sdpa(q, k, v, segments)


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--shapes", default="8x256,8x2048", help="local batch x seq_len, comma-separated")
    parser.add_argument("--layout", default="fsdp2", help=f"one of {', '.join(LAYOUTS)}")
    parser.add_argument("--steps", type=int, default=8, help="measured steps of each trainer")
    parser.add_argument("--warmup", type=int, default=2, help="steps of each left out of the statistics")
    parser.add_argument("--kernels", action="store_true", help="time attention alone (one process), not steps")
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.kernels:
        print(f"machine: {machine_description()}; load average before: {load_average()}", flush=True)
        kernels(args.shapes, args.steps)
        return
    layout = LAYOUTS[args.layout]
    print(f"machine: {machine_description()}; {layout.name}; load average before: {load_average()}", flush=True)
    print(f"{'tokens/rank':>12s} {'block_causal s':>15s} {'causal s':>9s} {'ratio':>6s} {'paired':>7s}  load after")
    for shape in args.shapes.split(","):
        raw = run_workers(os.path.abspath(__file__), layout, ["--shape", shape, "--steps", str(args.steps),
                                                              "--warmup", str(args.warmup)], args.overrides)
        b, c = raw["times"]["block_causal"], raw["times"]["causal"]
        print(f"{shape:>12s} {statistics.median(b):15.3f} {statistics.median(c):9.3f} "
              f"{statistics.median(b) / statistics.median(c):6.3f} "
              f"{statistics.median(x / y for x, y in zip(b, c)):7.3f}  {raw['load_average']}", flush=True)


if __name__ == "__main__":
    main()
