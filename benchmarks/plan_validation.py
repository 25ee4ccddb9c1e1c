"""The planner's predictions against published runs (docs/planning.md, benchmarks/README.md §17).

    python benchmarks/plan_validation.py [ROW ...]     # all rows, or the named ones
    python benchmarks/plan_validation.py --list        # the rows' names

Each row is a published run: its layout as train.py overrides, its cluster, and its published
tokens/s per GPU (or MFU) and memory. The script prints one JSON line per row with the prediction.
Nothing here feeds back into the model: the cluster constants come from their cited sources.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.planning.clusters import load_cluster  # noqa: E402
from torchtitan.planning.cost import estimate  # noqa: E402
from torchtitan.planning.dry_run import dry_run  # noqa: E402

TT = "h100-hbm2e-96g-500w"
C8, C70, C405 = (str(REPO / "train_configs" / f"llama3_{m}.toml") for m in ("8b", "70b", "405b"))
_8B = ["--job.config_file", C8, "--training.seq_len=8192"]
_CP = ["--job.config_file", C8, "--activation_checkpoint.mode=full", "--training.batch_size=1"]
_405 = ["--job.config_file", C405, "--training.batch_size=32", "--parallelism.pipeline_parallel_microbatches=32",
        "--parallelism.tensor_parallel_degree=8", "--parallelism.pipeline_parallel_degree=8"]
# name: (cluster, world size, overrides, pp ranks simulated, published tokens/s/GPU, published MFU, published GiB)
_PAPER = ["--job.config_file", C405, "--training.batch_size=32", "--parallelism.tensor_parallel_degree=8",
          "--parallelism.pipeline_parallel_degree=16", "--parallelism.pipeline_parallel_schedule=Interleaved1F1B",
          "--parallelism.pipeline_parallel_stages_per_rank=2", "--parallelism.pipeline_parallel_microbatches=32"]

# Mixture-of-experts rows (routing balanced, as the published runs force it). Megatron-Core's MoE README,
# "Reference Best Parallel Mapping" (MCore v0.8, 8x H100 80GB per node, 8x400 Gb/s IB): Mixtral 8x7B dropless,
# 64 GPUs, seq 4096, TP 1, EP 8, PP 4, VP 8, MBS 1, GBS 256, BF16; 438 TFLOP/s per GPU at v0.8 (468 at v0.9).
# Megatron-Bridge docs/performance-summary.md (25.11 NeMo container, DGX-H100, balanced dropless): Qwen3-30B-A3B
# 16 GPUs FP8-CS GBS 512 MBS 2 TP 1 PP 2 VP 24 EP 8, 5,275 tokens/s/GPU; Qwen3-235B-A22B 256 GPUs FP8-CS GBS 2048
# MBS 1 TP 2 PP 8 VP 4 EP 32, 1,575 tokens/s/GPU. This project runs BF16; the rows keep the published pipeline and
# EP (see benchmarks/README.md section 17); the TP 2 row is the published layout, EP borrowing TP's ranks.
_MOE = ["--job.config_file", C8, "--training.seq_len=4096", "--activation_checkpoint.mode=none"]
_MIXTRAL = [*_MOE, "--model.name=mixtral", "--model.flavor=8x7B", "--training.batch_size=16",
            "--parallelism.data_parallel_shard_degree=16", "--parallelism.expert_parallel_degree=8",
            "--parallelism.pipeline_parallel_degree=4", "--parallelism.pipeline_parallel_schedule=Interleaved1F1B",
            "--parallelism.pipeline_parallel_stages_per_rank=8", "--parallelism.pipeline_parallel_microbatches=16"]
_Q30 = [*_MOE, "--model.name=qwen3", "--model.flavor=30B-A3B", "--training.batch_size=64",
        "--parallelism.data_parallel_shard_degree=8", "--parallelism.expert_parallel_degree=8",
        "--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_schedule=Interleaved1F1B",
        "--parallelism.pipeline_parallel_stages_per_rank=24", "--parallelism.pipeline_parallel_microbatches=32"]
_Q235 = [*_MOE, "--model.name=qwen3", "--model.flavor=235B-A22B", "--training.batch_size=64",
         "--parallelism.data_parallel_shard_degree=32", "--parallelism.expert_parallel_degree=32",
         "--parallelism.pipeline_parallel_degree=8", "--parallelism.pipeline_parallel_schedule=Interleaved1F1B",
         "--parallelism.pipeline_parallel_stages_per_rank=4", "--parallelism.pipeline_parallel_microbatches=64"]
# The published layout itself: TP 2 x EP 32 (EP borrows TP's ranks: dp_shard 16 cannot hold 32), 16 x 2 x 8 = 256.
_Q235_TP2 = [*_MOE, "--model.name=qwen3", "--model.flavor=235B-A22B", "--training.batch_size=128",
             "--parallelism.data_parallel_shard_degree=16", "--parallelism.tensor_parallel_degree=2",
             "--parallelism.expert_parallel_degree=32", "--parallelism.pipeline_parallel_degree=8",
             "--parallelism.pipeline_parallel_schedule=Interleaved1F1B",
             "--parallelism.pipeline_parallel_stages_per_rank=4", "--parallelism.pipeline_parallel_microbatches=128"]
MOE_ROWS = {
    "mixtral-8x7b-ep8-pp4-vp8": ("h100-sxm-80g", 64, _MIXTRAL, None, None, 438e12 / 989e12, None),
    # The same layout with full activation checkpointing: what fits 80 GB in this project (section 17).
    "mixtral-8x7b-ep8-pp4-vp8-full-ac": ("h100-sxm-80g", 64, [*_MIXTRAL, "--activation_checkpoint.mode=full"], None,
                                         None, 438e12 / 989e12, None),
    "qwen3-30b-a3b-ep8-pp2-vp24": ("h100-sxm-80g", 16, _Q30, None, 5275, None, None),
    "qwen3-235b-a22b-ep32-pp8-vp4": ("h100-sxm-80g", 256, _Q235, [0, 7], 1575, None, None),
    "qwen3-235b-a22b-tp2-ep32-pp8-vp4": ("h100-sxm-80g", 256, _Q235_TP2, [0, 7], 1575, None, None),
}

# The published FP8 rows again, now in Float8 as they were run: TorchTitan's 70B row used Float8 (tensorwise,
# FP8 all-gather with precomputed scales, as its Float8 recipe for FSDP); Megatron-Bridge's FP8-CS is current
# (per-tensor, dynamic) scaling, which is the tensorwise recipe. Routed experts take FP8 grouped GEMMs on CUDA.
_F8 = ["--model.converters=float8", "--float8.recipe_name=tensorwise"]
_F8_GATHER = [*_F8, "--float8.enable_fsdp_float8_all_gather", "--float8.precompute_float8_dynamic_scale_for_fsdp"]
FLOAT8_ROWS = {
    "70b-fsdp32-tp8-float8": (TT, 256, ["--job.config_file", C70, "--training.batch_size=16", *_F8_GATHER], None, 829,
                              None, 71.9),
    "qwen3-30b-a3b-ep8-pp2-vp24-float8": ("h100-sxm-80g", 16, [*_Q30, *_F8], None, 5275, None, None),
    "qwen3-235b-a22b-ep32-pp8-vp4-float8": ("h100-sxm-80g", 256, [*_Q235, *_F8], [0, 7], 1575, None, None),
}

ROWS = {
    "8b-fsdp8": (TT, 8, [*_8B, "--training.batch_size=2", "--activation_checkpoint.mode=selective"], None,
                 5762, None, 82.4),
    "8b-fsdp128": (TT, 128, [*_8B, "--training.batch_size=2", "--activation_checkpoint.mode=selective"], None,
                   5605, None, 67.0),
    "8b-cp1-32k": (TT, 8, [*_CP, "--training.seq_len=32768"], None, 3890, None, 83.9),
    "8b-cp2-64k": (TT, 8, [*_CP, "--training.seq_len=65536", "--parallelism.context_parallel_degree=2"], None,
                   2540, None, 84.2),
    "8b-cp4-128k": (TT, 8, [*_CP, "--training.seq_len=131072", "--parallelism.context_parallel_degree=4"], None,
                    1071, None, 84.0),
    "8b-cp8-256k": (TT, 8, [*_CP, "--training.seq_len=262144", "--parallelism.context_parallel_degree=8"], None,
                    548, None, 84.5),
    "70b-fsdp32-tp8": (TT, 256, ["--job.config_file", C70, "--training.batch_size=16"], None, 829, None, 71.9),
    "405b-1f1b": (TT, 512, [*_405, "--parallelism.pipeline_parallel_schedule=1F1B",
                            "--parallelism.pipeline_parallel_stages_per_rank=1"], [0, 7], 100, None, 82.5),
    "405b-interleaved": (TT, 512, [*_405, "--parallelism.pipeline_parallel_schedule=Interleaved1F1B",
                                   "--parallelism.pipeline_parallel_stages_per_rank=2"], [0, 7], 128, None, 72.7),
    # Llama 3 paper (arXiv:2407.21783, Table 4): 8,192 H100s, TP 8, PP 16, DP 64, 16M tokens per batch; its
    # section 3.3.2 trains 8K sequences without activation checkpointing. The full-AC variant is what fits
    # this project's schedule in 80 GB (benchmarks/README.md section 17).
    "405b-llama3-paper": ("h100-sxm-80g", 8192, [*_PAPER, "--activation_checkpoint.mode=none"], [0, 15], None, 0.43,
                          None),
    "405b-llama3-paper-full-ac": ("h100-sxm-80g", 8192, [*_PAPER, "--activation_checkpoint.mode=full"], [0, 15], None,
                                  0.43, None),
    **MOE_ROWS,
    **FLOAT8_ROWS,
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("rows", nargs="*", metavar="ROW", help="rows to predict (default: all; --list names them)")
    p.add_argument("--list", action="store_true", help="print the rows' names and stop")
    a = p.parse_args(argv)
    unknown = [name for name in a.rows if name not in ROWS]
    if unknown:
        p.error(f"unknown row(s) {', '.join(unknown)}; --list names the rows")
    if a.list:
        print("\n".join(ROWS))
        return
    for name in a.rows or list(ROWS):
        cluster, world, args, pp_ranks, tps, mfu, gib = ROWS[name]
        start = time.perf_counter()
        e = estimate(dry_run(ConfigManager().parse_args(args), world, pp_ranks=pp_ranks), load_cluster(cluster))
        row = {"row": name, "cluster": cluster, "world_size": world, "overrides": args,
               "published_tps": tps, "predicted_tps": e.tokens_per_second_per_gpu,
               "published_mfu": mfu, "predicted_mfu": e.mfu,
               "published_gib": gib, "predicted_gib": e.peak_memory_gib, "tracked_gib": e.tracked_peak_gib,
               "bound": e.bound, "compute_s": e.compute_s, "exposed_comm_s": e.exposed_comm_s,
               "bubble_s": e.bubble_s, "largest": e.largest_consumer, "seconds": time.perf_counter() - start}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
