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
    LAYOUTS,
    benchmark_parser,
    build_trainer,
    end_worker,
    full_param_numel,
    group_labels,
    load_average,
    machine_description,
    make_comm_counter,
    peak_rss_bytes,
    run_workers,
    state_bytes,
)

WARMUP_STEPS = 2


def _tp_local_numel(p) -> int:
    """Elements of ``p`` one TP rank holds before FSDP shards it (the FSDP all-gather's output)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return p.numel()
    names = p.device_mesh.mesh_dim_names or ()
    split = 1
    for i, placement in enumerate(p.placements):
        if placement.is_shard() and i < len(names) and names[i] == "tp":
            split *= p.device_mesh.size(i)
    return p.numel() // split


def analytic_comm(trainer, counted_steps: int) -> dict[str, int]:
    """Bytes each ``kind@group`` collective *should* move on this rank (rank 0) for its layout.

    FSDP (over ``dp_shard_cp``): forward all-gathers every parameter this rank's TP slice
    and pipeline stage hold. Backward all-gathers again every group resharded after forward;
    the "default" policy keeps the last block and the root (embeddings, final norm, output)
    gathered, and under PP nothing is resharded. Every gradient is reduce-scattered once;
    HSDP and DDP then all-reduce the reduced shard over the replicas.

    TP (Megatron): per block two regions, each with one collective in forward and its
    transpose in backward, plus one pair for the embedding and one for the output
    projection; the buffer is one micro-batch of activations (B x L/cp x dim). Under SP
    the pairs are all-gather + reduce-scatter, without SP two all-reduces.

    CP: each block all-gathers K and V over ``cp`` (B x L x local KV heads x head dim each)
    and reduce-scatters their gradients in backward.

    PP: each micro-batch sends one activation to the next stage and receives its gradient
    (stage 0's view); the residual stream is sequence-sharded under TP+SP.
    """
    import torch

    cfg, dims, args = trainer.cfg, trainer.dims, trainer.model_args
    model = trainer.model_parts[0]
    mp = cfg.training.mixed_precision_param
    param_dtype = next(model.parameters()).dtype
    if mp != "auto":
        param_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[mp]
    size = torch.tensor([], dtype=param_dtype).element_size()  # parameters and activations
    reduce_size = {"float32": 4, "bfloat16": 2}[cfg.training.mixed_precision_reduce]

    params = {n: _tp_local_numel(p) for part in trainer.model_parts for n, p in part.named_parameters()}
    numel = sum(params.values())
    last = max((int(k) for part in trainer.model_parts for k in part.layers.keys()), default=-1)
    last_numel = sum(v for n, v in params.items() if n.startswith(f"layers.{last}."))
    root_numel = sum(v for n, v in params.items() if not n.startswith("layers."))
    shard, replicate = dims.degree("dp_shard_cp"), dims.dp_replicate
    policy = cfg.parallelism.fsdp_reshard_after_forward
    if policy == "never" or (dims.pp_enabled and policy == "default"):
        backward_gather = 0
    elif policy == "always":
        backward_gather = numel
    else:
        backward_gather = numel - last_numel - root_numel
    out: dict[str, int] = {}

    def add(kind: str, nbytes: int) -> None:
        out[kind] = out.get(kind, 0) + nbytes * counted_steps

    if shard > 1:
        add("all_gather@fsdp", (numel + backward_gather) * size)
        add("reduce_scatter@fsdp", numel * reduce_size)
    if replicate > 1:
        add("all_reduce@replicate", numel * reduce_size // shard)

    # Forward passes per step on this rank: gradient-accumulation micro-steps x pipeline micro-batches.
    passes = trainer.grad_accum * (trainer.pipeline.microbatches if trainer.pipeline else 1)
    micro_batch = cfg.training.batch_size // passes
    tokens = micro_batch * cfg.training.seq_len // dims.cp  # this rank's tokens per pass
    blocks = sum(len(part.layers) for part in trainer.model_parts)
    has_embedding = any(part.tok_embeddings is not None for part in trainer.model_parts)
    has_output = any(part.output is not None for part in trainer.model_parts)
    if dims.tp > 1:
        # Forward collectives per pass: 2 per block, 1 for the embedding output; backward
        # adds the transposes of those and of the output projection's input gather (SP).
        collectives = 4 * blocks + has_embedding + has_output
        activation = tokens * args.dim * size
        if cfg.parallelism.enable_sequence_parallel:
            add("all_gather@tp", collectives * activation * passes)
            add("reduce_scatter@tp", collectives * activation * passes)
        else:
            add("all_reduce@tp", collectives * activation * passes)
        if has_output and not dims.loss_parallel_enabled:
            add("all_gather@tp", tokens * args.vocab_size * size * passes)  # the vocab-sharded logits
    if dims.cp > 1:
        kv = micro_batch * cfg.training.seq_len * (args.n_kv_heads // dims.tp) * args.head_dim * size
        add("all_gather@cp", 2 * blocks * kv * passes)
        add("reduce_scatter@cp", 2 * blocks * kv * passes)
    if dims.pp > 1:
        seq_split = dims.tp if (dims.tp > 1 and cfg.parallelism.enable_sequence_parallel) else 1
        boundary = tokens // seq_split * args.dim * size
        add("send@pp", boundary * passes)
        add("recv@pp", boundary * passes)
    return out


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from torchtitan.models.common.decoder import Decoder

    rss_at_start = peak_rss_bytes()  # torch and the project imported, nothing built yet

    trainer = build_trainer(args.dump, ["--metrics.enable_tensorboard=false", "--metrics.log_freq=1000",
                                        f"--training.steps={WARMUP_STEPS + args.steps + 1}", *args.overrides])
    trainer.step_strategy.begin(trainer.step, trainer.grad_accum)  # what Trainer.train starts, before _run_step
    for _ in range(WARMUP_STEPS):
        trainer._run_step()
    # PyTorch's CommDebugMode would count calls only, and on torch 2.13 its module tracker
    # fails inside this model's forward (IndexError in _fw_set_module_hook), so the
    # counting mode of common.py does the work.
    # Gradients exist only between backward and zero_grad: look just before the optimizer step,
    # where parameters, gradients and optimizer state are all held at once.
    held: dict[str, int] = {}
    trainer.optimizer.register_step_pre_hook(
        lambda *_: held.update(state_bytes(trainer.model_parts, trainer.optimizer)))
    counter = make_comm_counter(group_labels(trainer))
    with counter:
        for _ in range(args.steps):
            trainer._run_step()
    held["optimizer"] = state_bytes(trainer.model_parts, trainer.optimizer)["optimizer"]
    with torch.device("meta"):
        numel = full_param_numel([Decoder(trainer.model_args)])  # the whole model, every stage
    # Every dim but dp_replicate splits the state: FSDP over dp_shard x cp, TP, PP by stages.
    dims = trainer.dims
    shard = dims.degree("dp_shard_cp") * dims.tp * dims.pp
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
            "layout": {d: dims.degree(d) for d in ("dp_replicate", "dp_shard", "cp", "tp", "pp")},
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
    end_worker(trainer)


def _fmt_mib(b: float) -> str:
    return f"{b / 2**20:8.3f}"


def report(name: str, r: dict) -> list[str]:
    degrees = " ".join(f"{d}={n}" for d, n in r["layout"].items() if n > 1)
    lines = [f"## {name}: world {r['world']} ({degrees}); state split {r['shard_degree']} ways "
             f"(dp_shard x cp x tp x pp), {r['param_numel']:,} parameters"]
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
    lines.append("communication per step, rank 0 (MiB)    calls  measured  analytic  ratio")
    for kind in sorted(set(comm) | set(r["analytic_comm"])):
        got = comm.get(kind, {"calls": 0, "bytes": 0})
        want = r["analytic_comm"].get(kind)
        ratio = f"{got['bytes'] / want:.4f}" if want else "   -  "
        want_text = _fmt_mib(want / steps) if want else "       -"
        lines.append(f"  {kind:36s} {got['calls'] / steps:6.1f}  {_fmt_mib(got['bytes'] / steps)}  "
                     f"{want_text}  {ratio}")
    return lines


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, from {', '.join(LAYOUTS)}")
    parser.add_argument("--steps", type=int, default=2, help="steady-state steps counted")
    parser.add_argument("--json", help="also write the raw results here")
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
