"""Memory held per rank and communication volume per step, per data-parallel layout.

    python benchmarks/footprint.py                      # FSDP 2, FSDP 8, HSDP 2x4, DDP 8
    python benchmarks/footprint.py --layouts fsdp8 --json out.json

For each layout it trains the debug model through the project's Trainer for a few steps,
then reports, per rank:

- parameter, gradient and optimizer-state bytes held between steps, against the ideal
  ``total / shard degree`` (target <= 1.05x), and the peak RSS of the process;
- bytes per collective kind (all-gather, reduce-scatter, all-reduce, send/recv) issued in
  one steady-state step, counted by a TorchDispatchMode over the c10d ops, against the
  analytic value for the layout (target <= 1.02x).

Byte counts are deterministic: the machine's load does not change them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    LAYOUTS, build_trainer, full_param_numel, load_average, machine_description, make_comm_counter,
    peak_rss_bytes, run_workers, state_bytes,
)

WARMUP_STEPS = 2


def analytic_comm(trainer, counted_steps: int) -> dict[str, int]:
    """Bytes per step each collective kind *should* move for this layout and FSDP policy.

    Forward all-gathers every parameter once. Backward all-gathers again every FSDP group
    that was resharded after forward; the project's "default" policy keeps the last block
    and the root (embeddings, final norm, output) gathered, since backward needs them at
    once. Backward reduce-scatters every gradient over the shard group; HSDP and DDP then
    all-reduce the reduced shard over the replicas.
    """
    import torch

    cfg, dims = trainer.cfg, trainer.dims
    model = trainer.model_parts[0]
    param_dtype = next(model.parameters()).dtype
    mp = cfg.training.mixed_precision_param
    if mp != "auto":
        param_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[mp]
    reduce_size = {"float32": 4, "bfloat16": 2}[cfg.training.mixed_precision_reduce]
    param_size = torch.tensor([], dtype=param_dtype).element_size()

    numel = full_param_numel(trainer.model_parts)
    last = max(model.layers.keys(), key=int)
    last_numel = sum(p.numel() for p in model.layers[last].parameters())
    root_numel = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("layers."))
    shard, replicate = dims.degree("dp_shard_cp"), dims.dp_replicate
    policy = cfg.parallelism.fsdp_reshard_after_forward
    if policy == "never":
        backward_gather = 0
    elif policy == "always":
        backward_gather = numel
    else:
        backward_gather = numel - last_numel - root_numel
    out: dict[str, int] = {}
    if shard > 1:
        out["all_gather"] = (numel + backward_gather) * param_size * counted_steps
        out["reduce_scatter"] = numel * reduce_size * counted_steps
    if replicate > 1:
        # FSDP2 pads each parameter's dim 0 to a multiple of the shard degree.
        out["all_reduce"] = numel * reduce_size // shard * counted_steps
    return out


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    rss_at_start = peak_rss_bytes()  # torch and the project imported, nothing built yet

    trainer = build_trainer(args.dump, ["--metrics.enable_tensorboard=false", "--metrics.log_freq=1000",
                                        f"--training.steps={WARMUP_STEPS + args.steps + 1}", *args.overrides])
    data_iter, losses = iter(trainer.dataloader), []
    for _ in range(WARMUP_STEPS):
        trainer._run_step(data_iter, losses)
    # PyTorch's CommDebugMode would count calls only, and on torch 2.13 its module tracker
    # fails inside this model's forward (IndexError in _fw_set_module_hook), so the
    # counting mode of common.py does the work.
    # Gradients exist only between backward and zero_grad: look just before the optimizer step,
    # where parameters, gradients and optimizer state are all held at once.
    held: dict[str, int] = {}
    trainer.optimizer.register_step_pre_hook(
        lambda *_: held.update(state_bytes(trainer.model_parts, trainer.optimizer)))
    counter = make_comm_counter()
    with counter:
        for _ in range(args.steps):
            trainer._run_step(data_iter, losses)
    held["optimizer"] = state_bytes(trainer.model_parts, trainer.optimizer)["optimizer"]
    numel = full_param_numel(trainer.model_parts)
    shard = trainer.dims.degree("dp_shard_cp")
    mine = {
        "rank": dist.get_rank(),
        "held": held,
        "peak_rss": peak_rss_bytes(),
        "rss_at_start": rss_at_start,
        "comm": counter.summary(),
    }
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        param_size = next(trainer.model_parts[0].parameters()).element_size()
        ideal_one = numel * param_size / shard
        result = {
            "world": dist.get_world_size(),
            "shard_degree": shard,
            "replicate_degree": trainer.dims.dp_replicate,
            "param_numel": numel,
            "ideal": {"params": ideal_one, "grads": ideal_one, "optimizer": 2 * ideal_one},
            "analytic_comm": analytic_comm(trainer, args.steps),
            "steps_counted": args.steps,
            "ranks": everyone,
            "load_average": load_average(),
        }
        with open(args.result, "w") as f:
            json.dump(result, f, indent=1)


def _fmt_mib(b: float) -> str:
    return f"{b / 2**20:8.3f}"


def report(name: str, r: dict) -> list[str]:
    lines = [f"## {name}: world {r['world']}, shard degree {r['shard_degree']}, replicate {r['replicate_degree']}, "
             f"{r['param_numel']:,} parameters"]
    worst = {k: max(rank["held"][k] for rank in r["ranks"]) for k in ("params", "grads", "optimizer")}
    total_ideal = sum(r["ideal"].values())
    lines.append("state held per rank (MiB, worst rank)   measured    ideal   ratio")
    for k in ("params", "grads", "optimizer"):
        lines.append(f"  {k:36s} {_fmt_mib(worst[k])} {_fmt_mib(r['ideal'][k])}   {worst[k] / r['ideal'][k]:.4f}")
    lines.append(f"  {'total':36s} {_fmt_mib(sum(worst.values()))} {_fmt_mib(total_ideal)}   "
                 f"{sum(worst.values()) / total_ideal:.4f}")
    rss = [rank["peak_rss"] for rank in r["ranks"] if rank["peak_rss"]]
    if rss:
        base = max(rank["rss_at_start"] or 0 for rank in r["ranks"])
        lines.append(f"  peak RSS per rank: max {max(rss) / 2**20:.0f} MiB, min {min(rss) / 2**20:.0f} MiB "
                     f"(of which {base / 2**20:.0f} MiB is Python + torch before the trainer is built)")
    comm = r["ranks"][0]["comm"]
    steps = r["steps_counted"]
    lines.append("communication per step, rank 0 (MiB)     calls  measured  analytic  ratio")
    for kind in sorted(set(comm) | set(r["analytic_comm"])):
        got = comm.get(kind, {"calls": 0, "bytes": 0})
        want = r["analytic_comm"].get(kind)
        ratio = f"{got['bytes'] / want:.4f}" if want else "   -  "
        want_text = _fmt_mib(want / steps) if want else "       -"
        lines.append(f"  {kind:36s} {got['calls'] / steps:6.1f}  {_fmt_mib(got['bytes'] / steps)}  {want_text}  {ratio}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", default="fsdp2,fsdp8,hsdp2x4,ddp8")
    parser.add_argument("--steps", type=int, default=2, help="steady-state steps counted")
    parser.add_argument("--json", help="also write the raw results here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--dump", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="extra config overrides, after --")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    print(f"machine: {machine_description()}; load average before: {load_average()}")
    results = {}
    for key in args.layouts.split(","):
        layout = LAYOUTS[key]
        results[key] = run_workers(os.path.abspath(__file__), layout, ["--steps", str(args.steps)], args.overrides)
        print("\n".join(report(layout.name, results[key])), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
