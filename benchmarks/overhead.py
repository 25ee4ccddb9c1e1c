"""Framework overhead: the project's Trainer against a minimal hand-written FSDP2 loop.

    python benchmarks/overhead.py                          # FSDP 2, FSDP 8, HSDP 2x4
    python benchmarks/overhead.py --layouts fsdp8 --steps 40 --profile
    python benchmarks/overhead.py -- --metrics.log_freq=10  # config overrides for the trainer

Both loops run in the same processes, on the same debug model, data, layout, FSDP policy
(last block and root kept gathered after forward), optimizer (AdamW, fused, as the trainer picks on CPU and CUDA),
linear-layer kernels (``training.cpu_matmul``) and gradient clipping. They take turns step by step in an ABBA order,
so a change in the machine's load hits both alike. Before each step every rank waits at a barrier; a step's time is the
slowest rank's. After the warm-up steps, the script prints the median step time of each
loop, their ratio (target <= 1.03) and the median of the paired ratios.

The trainer step is ``Trainer._run_step``: what ``Trainer.train`` runs per step (data,
forward/backward, clipping, optimizer, LR schedule, metrics and logging). The reference
step is only the math: forward, mean cross-entropy, backward, clip, AdamW, LR schedule.
``--profile`` adds a cProfile of rank 0's steps of each loop (the functions where the
trainer spends time the reference does not).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
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


class ReferenceLoop:
    """The smallest FSDP2 training loop that does the same math as the trainer."""

    def __init__(self, trainer) -> None:
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from torchtitan.datasets import DataLayout, build_dataloader, build_tokenizer
        from torchtitan.models.common.decoder import Decoder
        from torchtitan.models.common.parallel import use_attention
        from torchtitan.ops.cpu_kernels import use_onednn_linears
        from torchtitan.optim import build_lr_scheduler

        cfg, dims = trainer.cfg, trainer.dims
        if dims.dp_replicate > 1:
            mesh = init_device_mesh("cpu", (dims.dp_replicate, dims.dp_shard), mesh_dim_names=("rep", "shard"))
            dp_rank, dp_degree = mesh.get_rank(), dims.dp_replicate * dims.dp_shard
        else:
            mesh = init_device_mesh("cpu", (dims.dp_shard,), mesh_dim_names=("shard",))
            dp_rank, dp_degree = mesh.get_rank(), dims.dp_shard
        with torch.device("meta"):
            model = Decoder(trainer.model_args)
        # The trainer's CPU kernels (linear products among them), so that only overhead differs.
        if cfg.training.cpu_matmul == "onednn":
            use_onednn_linears(model)
        use_attention(model, cfg.model.attention_backend, "cpu", None, cfg.training.seq_len)
        blocks = list(model.layers.values())
        for i, block in enumerate(blocks):
            fully_shard(block, mesh=mesh, reshard_after_forward=i < len(blocks) - 1)
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
        model.to_empty(device="cpu")
        model.init_weights()
        self.model = model
        o, s, t = cfg.optimizer, cfg.lr_scheduler, cfg.training
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                           weight_decay=o.weight_decay, fused=True)
        # The project's schedule, built as the trainer builds it: both loops pay for the same one.
        self.scheduler = build_lr_scheduler(self.optimizer, warmup_steps=s.warmup_steps, decay_ratio=s.decay_ratio,
                                            decay_type=s.decay_type, lr_min=s.lr_min, total_steps=t.steps)
        self.max_norm = t.max_norm
        loader = build_dataloader(dataset_name=t.dataset, dataset_path=t.dataset_path,
                                  tokenizer=build_tokenizer(cfg.model.tokenizer_path),
                                  layout=DataLayout(t.seq_len, t.batch_size, dp_rank, dp_degree),
                                  positions=cfg.model.attn_mask_type == "block_causal")  # the trainer's mask too
        self.data = iter(loader)

    def step(self) -> None:
        import torch
        import torch.nn.functional as F

        inputs, labels, *positions = next(self.data)
        logits = self.model(inputs, *positions)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm, foreach=True)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)


def _top_functions(profile: cProfile.Profile, limit: int = 25) -> str:
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(limit)
    return out.getvalue()


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    total = args.warmup + args.steps
    trainer = build_trainer(args.dump, [f"--training.steps={total}", *args.overrides])
    reference = ReferenceLoop(trainer)
    trainer.step_strategy.begin(trainer.step, trainer.grad_accum)  # what Trainer.train starts, before _run_step
    steps = {"trainer": lambda: trainer._run_step(), "reference": reference.step}
    profiles = {name: cProfile.Profile() for name in steps}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(total):
        # ABBA: trainer first on even pairs, reference first on odd ones.
        order = ["trainer", "reference"] if i % 2 == 0 else ["reference", "trainer"]
        for name in order:
            dist.barrier()
            profile = profiles[name] if (args.profile and i >= args.warmup and dist.get_rank() == 0) else None
            start = wall_clock()
            if profile is not None:
                profile.runcall(steps[name])
            else:
                steps[name]()
            times[name].append(wall_clock() - start)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, times)
    if dist.get_rank() == 0:
        slowest = {name: [max(rank[name][i] for rank in everyone) for i in range(total)][args.warmup:]
                   for name in steps}
        result = {"times": slowest, "load_average": load_average(), "final_loss": trainer.readout.read()[0]}
        if args.profile:
            result["profiles"] = {name: _top_functions(p) for name, p in profiles.items()}
        with open(args.result, "w") as f:
            json.dump(result, f, indent=1)
    end_worker(trainer)


def summarize(times: dict[str, list[float]]) -> dict[str, float]:
    t, r = times["trainer"], times["reference"]
    return {
        "trainer_median_s": statistics.median(t),
        "reference_median_s": statistics.median(r),
        "ratio_of_medians": statistics.median(t) / statistics.median(r),
        "median_paired_ratio": statistics.median(a / b for a, b in zip(t, r)),
        "steps": len(t),
    }


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--layouts", default="fsdp2,fsdp8,hsdp2x4")
    parser.add_argument("--steps", type=int, default=30, help="measured steps of each loop")
    parser.add_argument("--warmup", type=int, default=4, help="steps of each loop left out of the statistics")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of rank 0's steps of each loop")
    parser.add_argument("--json", help="also write the raw results here")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    print(f"machine: {machine_description()}; load average before: {load_average()}", flush=True)
    worker_args = ["--steps", str(args.steps), "--warmup", str(args.warmup)] + (["--profile"] if args.profile else [])
    results = {}
    print(f"{'layout':10s} {'trainer s':>10s} {'reference s':>12s} {'ratio':>7s} {'paired':>7s}  load average after")
    for key in args.layouts.split(","):
        layout = LAYOUTS[key]
        raw = run_workers(os.path.abspath(__file__), layout, worker_args, args.overrides)
        s = summarize(raw["times"])
        results[key] = {**raw, "summary": s}
        print(f"{layout.name:10s} {s['trainer_median_s']:10.4f} {s['reference_median_s']:12.4f} "
              f"{s['ratio_of_medians']:7.3f} {s['median_paired_ratio']:7.3f}  {raw['load_average']}", flush=True)
        if args.profile:
            for name, text in raw["profiles"].items():
                print(f"--- {layout.name}: cProfile of rank 0, {name} steps ---\n{text}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
