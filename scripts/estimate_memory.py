"""Per-rank memory estimate for a training config, without allocating the model or any device.

    python scripts/estimate_memory.py --world_size 512 --job.config_file train_configs/llama3_8b.toml \\
        --parallelism.data_parallel_shard_degree 64 --parallelism.tensor_parallel_degree 8

Every argument but ``--world_size`` and ``--json`` is a config override, read exactly as
``train.py`` reads it. The script joins a *fake* process group of ``--world_size`` ranks
(one process, no communication), builds the model on the meta device, and applies the
project's own ``parallelize_llama`` (and pipeline split) as rank 0 of that world would.
The sharded parameters are then DTensors whose local shapes are exactly what a real rank
holds, so the per-rank state follows without allocating anything:

- parameters and gradients: the local shard of every parameter, in float32 (FSDP keeps the
  sharded master weights and their gradients in the parameters' own dtype);
- AdamW state: two float32 moments per parameter plus one step counter per parameter;
- with pipeline parallelism, the pipeline rank with the most state.

Rank 0 holds the largest shard of every unevenly split dimension (FSDP pads the others to
it), so its figures are the worst rank's.

Optionally (``--activations``) it runs one forward and backward of a transformer block on
fake tensors (FakeTensorMode: shapes and dtypes only, no memory) with the local micro-batch
shape, and counts the bytes autograd saves for backward. That gives a rough per-rank
activation figure for the chosen activation checkpointing; it ignores transient buffers,
the allocator's fragmentation and the logits of the loss, which are listed separately.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

GIB = 2**30


def _size(n: float) -> str:
    """Bytes in GiB, or in MiB below 1 GiB (the debug model's figures are a few MiB)."""
    return f"{n / GIB:9.3f} GiB" if n >= GIB else f"{n / 2**20:9.3f} MiB"


@dataclasses.dataclass
class StateEstimate:
    """Bytes one rank holds between backward and the optimizer step (worst pipeline rank)."""

    params: int
    grads: int
    optimizer: int
    param_numel_total: int  # whole model, unsharded
    local_param_numel: int
    pp_rank: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _fsdp_padded_numel(param: torch.Tensor) -> int:
    """Elements this rank stores for ``param``: FSDP2 pads dim 0 of every shard to the largest one."""
    local = _local(param)
    return local.numel()


def _join_fake_world(world_size: int) -> None:
    # Importing the module registers the "fake" backend: collectives return at once and move nothing.
    from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


def _model_args(cfg):
    from torchtitan.datasets import build_tokenizer
    from torchtitan.models import model_args, model_flavors

    args = model_args(cfg.model.name, cfg.model.flavor)
    if cfg.model.flavor not in model_flavors(cfg.model.name):  # a release states its own vocabulary
        return dataclasses.replace(args, max_seq_len=cfg.training.seq_len), f"vocabulary {args.vocab_size} from " \
            f"{cfg.model.flavor}"
    try:
        vocab = build_tokenizer(cfg.model.tokenizer_path).n_words
        note = f"vocabulary {vocab} from {cfg.model.tokenizer_path}"
    except (FileNotFoundError, ValueError, OSError):
        vocab = args.vocab_size
        note = f"vocabulary {vocab} from the flavor (tokenizer {cfg.model.tokenizer_path} not found)"
    return dataclasses.replace(args, vocab_size=vocab, max_seq_len=cfg.training.seq_len), note


def _stage_modules(cfg, dims, whole: torch.nn.Module) -> list[list[torch.nn.Module]]:
    """The meta modules each pipeline rank holds (one list per pp rank)."""
    if not dims.pp_enabled:
        return [[whole]]
    from torchtitan.distributed.pipeline_parallel import prune_to_stage
    from torchtitan.distributed.pipeline_plan import PipelinePlan

    plan = PipelinePlan.from_config(cfg, whole.args.n_layers)
    return [[prune_to_stage(whole, plan, s) for s in plan.stage_ids(r)] for r in range(dims.pp)]


def estimate_state(cfg, world_size: int, device_type: str = "cuda") -> tuple[StateEstimate, dict]:
    """Per-rank parameter/gradient/optimizer bytes for ``cfg`` on ``world_size`` ranks.

    ``device_type`` only picks the mixed-precision default ("auto"); sharded state is
    float32 either way.
    """
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import Transformer
    from torchtitan.models.llama3.parallelize import parallelize_llama

    args, vocab_note = _model_args(cfg)
    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    _join_fake_world(world_size)
    dims.build_mesh("cpu")
    with torch.device("meta"):
        whole = Transformer(args)
    total_numel = whole.num_params()
    best: StateEstimate | None = None
    for pp_rank, modules in enumerate(_stage_modules(cfg, dims, whole)):
        numel = n_tensors = 0
        for module in modules:
            parallelize_llama(module, dims, cfg, device_type)
            for p in module.parameters():
                numel += _fsdp_padded_numel(p)
                n_tensors += 1
        # Sharded parameters and their gradients stay float32; AdamW keeps exp_avg and
        # exp_avg_sq (float32) and a float32 step counter per parameter tensor.
        est = StateEstimate(params=4 * numel, grads=4 * numel, optimizer=8 * numel + 4 * n_tensors,
                            param_numel_total=total_numel, local_param_numel=numel, pp_rank=pp_rank)
        if best is None or est.total > best.total:
            best = est
    info = {"model_args": dataclasses.asdict(args), "vocab_note": vocab_note,
            "degrees": {"dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "cp": dims.cp,
                        "tp": dims.tp, "pp": dims.pp, "world_size": world_size}}
    return best, info


def estimate_activations(cfg, args, dims) -> dict[str, float]:
    """Saved-for-backward bytes of one block and of the loss, per rank, from a fake-tensor run."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from torchtitan.models.llama3.model import TransformerBlock, precompute_rope_cache

    mp = cfg.training.mixed_precision_param
    dtype = torch.bfloat16 if mp in ("auto", "bfloat16") else torch.float32
    batch, seq = cfg.training.batch_size, cfg.training.seq_len // dims.cp
    # Tensor parallelism splits heads and the FFN width across ranks; with sequence
    # parallelism the norms' inputs are split along the sequence too. Model that by running
    # the block with 1/tp of the heads and the FFN (exact for the matmul inputs and outputs).
    tp = dims.tp
    saved: dict[int, int] = {}
    weights: set[int] = set()

    def pack(t: torch.Tensor):
        # Count each storage once: views of one buffer are saved many times.
        key = t.untyped_storage()._cdata
        if key not in weights:  # weights are counted as (gathered) parameters, not activations
            saved[key] = max(saved.get(key, 0), t.untyped_storage().nbytes())
        return t

    default_dtype = torch.get_default_dtype()
    with FakeTensorMode():
        # Build in the compute dtype directly (.to() cannot swap fake parameters).
        torch.set_default_dtype(dtype)
        try:
            block = TransformerBlock(0, args)
        finally:
            torch.set_default_dtype(default_dtype)
        if tp > 1:
            # Shrink the per-rank projections: heads and FFN width divided by tp.
            hd = args.head_dim
            att, ffn = block.attention, block.feed_forward
            n_q, n_kv = args.n_heads // tp, (args.n_kv_heads or args.n_heads) // tp
            att.wq = torch.nn.Linear(args.dim, n_q * hd, bias=False, dtype=dtype)
            att.wk = torch.nn.Linear(args.dim, max(n_kv, 1) * hd, bias=False, dtype=dtype)
            att.wv = torch.nn.Linear(args.dim, max(n_kv, 1) * hd, bias=False, dtype=dtype)
            att.wo = torch.nn.Linear(n_q * hd, args.dim, bias=False, dtype=dtype)
            hidden = ffn.w1.out_features // tp
            ffn.w1 = torch.nn.Linear(args.dim, hidden, bias=False, dtype=dtype)
            ffn.w3 = torch.nn.Linear(args.dim, hidden, bias=False, dtype=dtype)
            ffn.w2 = torch.nn.Linear(hidden, args.dim, bias=False, dtype=dtype)
        weights = {p.untyped_storage()._cdata for p in block.parameters()}
        x = torch.empty(batch, seq, args.dim, dtype=dtype, requires_grad=True)
        rope = precompute_rope_cache(args.head_dim, seq, args.rope_theta, args.rope_scaling_params())
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = block(x, rope)
    per_block = float(sum(saved.values()))
    block_input = batch * seq * args.dim * torch.tensor([], dtype=dtype).element_size()
    if cfg.parallelism.enable_sequence_parallel and tp > 1:
        block_input /= tp
    mode = cfg.activation_checkpoint.mode
    if mode == "full":
        per_block_kept = block_input
    elif mode == "selective" and cfg.activation_checkpoint.selective_ac_option != "op":
        every = int(cfg.activation_checkpoint.selective_ac_option)
        per_block_kept = (block_input + (every - 1) * per_block) / every
    else:
        # "none", or selective "op": op-level AC keeps the matmul and attention outputs, which
        # are most of the saved bytes, so "no AC" is the honest upper bound here.
        per_block_kept = per_block
    vocab_local = args.vocab_size // (tp if dims.loss_parallel_enabled else 1)
    logits = batch * seq * vocab_local * (torch.tensor([], dtype=dtype).element_size() + 4)  # output + fp32 copy
    del out
    return {"per_block_saved": per_block, "per_block_kept": per_block_kept, "logits_and_loss": float(logits)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     add_help=True)
    parser.add_argument("--world_size", type=int, help="ranks of the job (default: $WORLD_SIZE or the product of "
                        "the degrees, which must then all be set)")
    parser.add_argument("--json", help="write the estimate here as JSON")
    parser.add_argument("--activations", action="store_true", help="also estimate activation memory (fake tensors)")
    own, rest = parser.parse_known_args(argv)

    from torchtitan.config import ConfigError, ConfigManager

    try:
        cfg = ConfigManager().parse_args(rest)
    except ConfigError as e:
        for problem in e.problems:
            print(f"config error: {problem}", file=sys.stderr)
        return 2
    world = own.world_size or int(os.environ.get("WORLD_SIZE", "0"))
    if not world:
        p = cfg.parallelism
        if p.data_parallel_shard_degree < 1:
            print("config error: give --world_size (data_parallel_shard_degree = -1 takes the ranks left over)",
                  file=sys.stderr)
            return 2
        world = math.prod([p.data_parallel_replicate_degree, p.data_parallel_shard_degree,
                           p.context_parallel_degree, p.tensor_parallel_degree, p.pipeline_parallel_degree])
    try:
        est, info = estimate_state(cfg, world)
    except ValueError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    d = info["degrees"]
    print(f"{cfg.model.name} {cfg.model.flavor}: {est.param_numel_total:,} parameters ({info['vocab_note']})")
    print(f"world {world}: dp_replicate {d['dp_replicate']} x dp_shard {d['dp_shard']} x cp {d['cp']} x "
          f"tp {d['tp']} x pp {d['pp']}" + (f" (worst pipeline rank: {est.pp_rank})" if d["pp"] > 1 else ""))
    print("per-rank state:")
    for name, value in [("parameters (fp32 shard)", est.params), ("gradients (fp32 shard)", est.grads),
                        ("AdamW state", est.optimizer), ("total", est.total)]:
        print(f"  {name:28s} {_size(value)}")
    ideal = 16 * est.param_numel_total / world
    print(f"  {'ideal 16 B x params / world':28s} {_size(ideal)}  (ratio {est.total / ideal:.3f}: "
          f"{'replicas, pipeline imbalance and padding' if est.total / ideal > 1.001 else 'fully sharded'})")
    out = {"state": dataclasses.asdict(est), "state_total": est.total, **info}
    if own.activations:
        from torchtitan.distributed import ParallelDims
        from torchtitan.models.llama3 import ModelArgs

        args = ModelArgs(**info["model_args"])
        dims = ParallelDims.from_config(cfg.parallelism, world)
        act = estimate_activations(cfg, args, dims)
        layers = math.ceil(args.n_layers / d["pp"])
        acts = act["per_block_kept"] * layers
        print(f"activations, rough (local micro-batch {cfg.training.batch_size} x {cfg.training.seq_len // d['cp']}, "
              f"AC {cfg.activation_checkpoint.mode}/{cfg.activation_checkpoint.selective_ac_option}):")
        print(f"  {'saved per block (no AC)':28s} {_size(act['per_block_saved'])}")
        print(f"  {f'kept for {layers} block(s)':28s} {_size(acts)}")
        print(f"  {'logits + fp32 loss input':28s} {_size(act['logits_and_loss'])}")
        print(f"  {'state + activations':28s} {_size(est.total + acts + act['logits_and_loss'])}  "
              f"(plus gathered parameters, buffers and allocator slack)")
        out["activations"] = act
    if own.json:
        with open(own.json, "w") as f:
            json.dump(out, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
