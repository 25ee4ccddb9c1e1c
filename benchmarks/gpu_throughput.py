"""Single-GPU throughput of Llama 3 8B shapes (fewer layers): the project's model vs plain PyTorch.

    python benchmarks/gpu_throughput.py                       # all variants, layers chosen to fit
    python benchmarks/gpu_throughput.py --variants project-compile-sac --layers 4
    python benchmarks/gpu_throughput.py --smoke               # CPU, tiny shapes: checks the logic only
    python benchmarks/gpu_throughput.py --float8              # bf16 against Float8 (tensorwise, rowwise)

Each variant runs in its own process (a fresh allocator and compile cache) and reports
tokens/s, TFLOP/s, MFU and peak memory on one device:

- project-*:   the project's Decoder, its activation checkpointing and compile helpers
               (parallelize.py) and bf16 through FSDP2's MixedPrecisionPolicy on a 1-GPU mesh,
               the project's fused AdamW;
- reference-*: a Llama 3 block written here with plain PyTorch (nn.Linear, F.rms_norm,
               complex RoPE, SDPA), bf16 autocast over float32 weights, fused AdamW;
- project-*-fp8tw / -fp8rw: the same with Float8 linears (``--model.converters float8``, recipe
               tensorwise / rowwise; the output head stays bf16), applied between build and AC/compile
               as the trainer does; ``--float8`` runs them beside their bf16 counterparts;
- torchtitan-*: the peer's own Trainer on the same shapes (benchmarks/peer/peer_torchtitan.py;
               needs ``--peer-site`` pointing at a folder where the `torchtitan` wheel is installed).

Both use seq 8192 (``--seq``), batch 1, the 8B dims (dim 4096, 32 heads, 8 KV heads,
FFN 14336, vocab 128256) and the same FLOP count (torchtitan.models.llama3.flops_per_token),
so their MFU figures compare directly. ``--layers`` defaults to 4 on devices with under
100 GiB (H100 80 GB) and 8 above (H200 141 GB).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

VARIANTS = ["reference-eager", "project-eager", "reference-compile", "project-compile",
            "project-compile-sac", "project-eager-sac"]
# The peer (the `torchtitan` package from PyPI, given by --peer-site): run by peer_torchtitan.py.
PEER_VARIANTS = ["torchtitan-eager", "torchtitan-compile", "torchtitan-compile-sac"]
# --float8: bf16 and Float8 (tensorwise, rowwise), eager and compiled, on the same shapes.
FLOAT8_VARIANTS = ["project-eager", "project-compile", "project-eager-fp8tw", "project-compile-fp8tw",
                   "project-eager-fp8rw", "project-compile-fp8rw"]
FLOAT8_RECIPES = {"fp8tw": "tensorwise", "fp8rw": "rowwise"}


# ---- a plain-PyTorch Llama 3 (the reference) ------------------------------------------
def build_reference(args, device):
    import torch
    import torch.nn.functional as F
    from torch import nn

    from torchtitan.models.layers import rope_frequencies
    from torchtitan.models.llama3 import ffn_hidden_dim

    hd, n_kv = args.head_dim, args.n_kv_heads

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.n1, self.n2 = nn.RMSNorm(args.dim, eps=args.norm_eps), nn.RMSNorm(args.dim, eps=args.norm_eps)
            self.wqkv = nn.Linear(args.dim, (args.n_heads + 2 * n_kv) * hd, bias=False)
            self.wo = nn.Linear(args.n_heads * hd, args.dim, bias=False)
            hidden = ffn_hidden_dim(args)
            self.w13 = nn.Linear(args.dim, 2 * hidden, bias=False)
            self.w2 = nn.Linear(hidden, args.dim, bias=False)

        def forward(self, x, freqs):
            b, s, _ = x.shape
            q, k, v = self.wqkv(self.n1(x)).split([args.n_heads * hd, n_kv * hd, n_kv * hd], dim=-1)
            q, k, v = q.view(b, s, -1, hd), k.view(b, s, -1, hd), v.view(b, s, -1, hd)

            def rope(t):
                tc = torch.view_as_complex(t.float().reshape(*t.shape[:-1], -1, 2))
                return torch.view_as_real(tc * freqs[:, None, :]).flatten(-2).type_as(t)

            q, k = rope(q), rope(k)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True, enable_gqa=True)
            h = x + self.wo(o.transpose(1, 2).reshape(b, s, -1))
            a, g = self.w13(self.n2(h)).chunk(2, dim=-1)
            return h + self.w2(F.silu(a) * g)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(args.vocab_size, args.dim)
            self.blocks = nn.ModuleList(Block() for _ in range(args.n_layers))
            self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
            self.out = nn.Linear(args.dim, args.vocab_size, bias=False)
            freqs = rope_frequencies(hd, args.rope_theta, args.rope_scaling_params())
            angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float64), freqs)
            self.register_buffer("freqs", torch.polar(torch.ones_like(angles), angles).to(torch.complex64),
                                 persistent=False)

        def forward(self, tokens):
            h = self.emb(tokens)
            freqs = self.freqs[: tokens.shape[1]]
            for block in self.blocks:
                h = block(h, freqs)
            return self.out(self.norm(h))

    with torch.device(device):
        model = Model()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else None
    return model


# ---- the project's model -------------------------------------------------------------------
def build_project(args, device, compile_: bool, sac: bool, float8: str | None = None):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from torchtitan.distributed.activation_checkpoint import apply_activation_checkpointing
    from torchtitan.distributed.compile import apply_compile
    from torchtitan.models.common.decoder import Decoder

    with torch.device("meta"):
        model = Decoder(args)
    if float8 is not None:  # the trainer's converter, between build and AC/compile (train_step/build.py)
        from torchtitan.config import ConfigManager
        from torchtitan.quantization.converters import model_label
        from torchtitan.quantization.float8 import convert_to_float8

        cfg = ConfigManager().parse_args(["--model.converters=float8", f"--float8.recipe_name={float8}"])
        print("float8:", convert_to_float8(model, cfg.float8, device.type, model_label(cfg.model)), file=sys.stderr)
    if sac:
        apply_activation_checkpointing(model, "selective", "op")
    if compile_:
        apply_compile(model)
    # On one device the trainer applies no FSDP and hence no mixed precision; wrapping a
    # 1-rank mesh gives the bf16 compute / fp32 master weights that multi-GPU runs get.
    mesh = init_device_mesh(device.type, (1,))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    model.to_empty(device=device)
    model.init_weights(buffer_device=device)
    return model


# Kernel-name patterns, checked in this order (attention kernels also mention sm90, so first).
KERNEL_CLASSES = [
    ("attention", ("flash", "fmha", "attention", "cudnn")),
    ("optimizer+clip", ("adam", "multi_tensor", "foreach")),
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "sm90_", "splitk")),
    ("copy/cast", ("copy", "memcpy", "memset", "cat_", "chunk_cat", "fill")),
    ("norm/rope/elementwise", ("",)),
]


def kernel_breakdown(prof, wall_s: float) -> dict:
    """Share of GPU kernel time per class over the profiled steps, and the idle share of the wall time."""
    from torch.autograd import DeviceType

    totals: dict[str, float] = {name: 0.0 for name, _ in KERNEL_CLASSES}
    top: dict[str, float] = {}
    for e in prof.events():
        # GPU-side user annotations (FSDP::..., Optimizer.step#...) span kernels counted anyway.
        if e.device_type != DeviceType.CUDA or getattr(e, "is_user_annotation", False):
            continue
        us = e.time_range.elapsed_us()
        name = e.name.lower()
        for cls, needles in KERNEL_CLASSES:
            if any(n in name for n in needles):
                totals[cls] += us
                break
        top[e.name[:90]] = top.get(e.name[:90], 0.0) + us
    busy = sum(totals.values())
    return {"gpu_busy_ms_per_step": busy / 2e3, "wall_ms_per_step": wall_s * 1e3 / 2,
            "share_pct": {k: round(100 * v / busy, 1) for k, v in totals.items()} if busy else {},
            "top_kernels_ms_per_step": {k: round(v / 2e3, 2)
                                        for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:40]}}


def run_variant(variant: str, layers: int, seq: int, steps: int, warmup: int, smoke: bool,
                profile_steps: bool = False) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from torchtitan.distributed.lifecycle import shutdown_distributed
    from torchtitan.metrics import peak_flops
    from torchtitan.models.common.flops import flops_per_token
    from torchtitan.models.llama3 import llama3_flavors
    from torchtitan.optim import build_optimizer

    device = torch.device("cuda", 0) if not smoke else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    if smoke:
        args = dataclasses.replace(llama3_flavors["debugmodel"], n_layers=layers, max_seq_len=seq)
    else:
        args = dataclasses.replace(llama3_flavors["8B"], n_layers=layers, max_seq_len=seq)
    kind, *flags = variant.split("-")
    compile_, sac = "compile" in flags, "sac" in flags
    torch.manual_seed(0)
    recipes = [FLOAT8_RECIPES[f] for f in flags if f in FLOAT8_RECIPES]
    if kind == "project":
        model = build_project(args, device, compile_, sac, float8=recipes[0] if recipes else None)
        autocast = None
    else:
        if sac:
            raise ValueError("the reference has no selective AC variant")
        model = build_reference(args, device)
        if compile_:
            for block in model.blocks:
                block.compile(fullgraph=True)
        autocast = torch.bfloat16 if device.type == "cuda" else None
    opt = build_optimizer(model.parameters(), name="AdamW", lr=3e-4, eps=1e-8, weight_decay=0.1,
                          betas=(0.9, 0.95), device_type=device.type)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    gen = torch.Generator().manual_seed(0)
    times, losses = [], []
    profile = None
    for step in range(warmup + steps + (2 if profile_steps else 0)):
        if profile_steps and step == warmup + steps:
            profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                         torch.profiler.ProfilerActivity.CUDA])
            profile.__enter__()
        tokens = torch.randint(0, args.vocab_size, (1, seq + 1), generator=gen).to(device)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
            logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if warmup <= step < warmup + steps:
            times.append(time.perf_counter() - start)
        losses.append(float(loss))
    breakdown = None
    if profile is not None:
        profile.__exit__(None, None, None)
        breakdown = kernel_breakdown(profile, wall_s=2 * statistics.median(times))
    step_time = statistics.median(times)
    tps = seq / step_time
    flops = flops_per_token(args, seq) * tps
    peak = peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    result = {
        "variant": variant, "layers": layers, "seq": seq, "step_s": step_time, "tokens_per_s": tps,
        "tflops": flops / 1e12, "mfu_pct": 100 * flops / peak if peak else None,
        "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else None,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "loss_first_last": [losses[0], losses[-1]],
        "params": sum(p.numel() for p in model.parameters()),
    }
    if breakdown:
        result["profile"] = breakdown
    shutdown_distributed(ok=True, timeout_seconds=60)
    return result


def run_peer(variant: str, layers: int, seq: int, steps: int, warmup: int, peer_site: str) -> dict:
    """The peer in its own process; FLOPs counted with the project's formula on the same shapes."""
    import torch

    from benchmarks.peer.peer_torchtitan import parse_step_lines
    from torchtitan.metrics import peak_flops
    from torchtitan.models.common.flops import flops_per_token
    from torchtitan.models.llama3 import llama3_flavors

    flags = variant.split("-")[1:]
    cmd = [sys.executable, str(REPO / "benchmarks" / "peer" / "peer_torchtitan.py"), "--layers", str(layers),
           "--seq", str(seq), "--steps", str(steps), "--warmup", str(warmup)]
    cmd += ["--compile"] if "compile" in flags else []
    cmd += ["--sac"] if "sac" in flags else []
    env = dict(os.environ, PEER_SITE=peer_site)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=420)
    out = proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PEER ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"exit {proc.returncode}\n{out[-3000:]}")
    info = json.loads(lines[-1][len("PEER "):])
    steps_info = parse_step_lines(out, warmup)
    args = dataclasses.replace(llama3_flavors["8B"], n_layers=layers, max_seq_len=seq)
    tps = steps_info["tokens_per_s"]
    flops = flops_per_token(args, seq) * tps
    name = torch.cuda.get_device_name(0)
    peak = peak_flops(name)
    # The peer resets the device's peak statistics at every log step, so a peak read when it ends covers only
    # the time after its last step (its parameters and optimizer state): its memory figure is the largest
    # reserved peak its own step lines report over the timed steps. No allocated peak covers its steps.
    return {"variant": variant, "layers": layers, "seq": seq, "step_s": seq / tps, "tokens_per_s": tps,
            "tflops": flops / 1e12, "mfu_pct": 100 * flops / peak if peak else None, "peak_mem_gib": None,
            "peak_reserved_gib": steps_info["peak_mem_gib"], "device": name, "torch": torch.__version__,
            "peer_version": info["peer_version"], "loss_first_last": [float("nan"), float("nan")]}


def default_layers() -> int:
    import torch

    if not torch.cuda.is_available():
        return 2
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    # fp32 weights + grads + AdamW = 16 B/param: 4 layers (1.9 B params, ~31 GiB) leave an
    # 80 GB H100 room for 8K-token activations and the 128K-vocab logits; a 141 GB H200 fits 8.
    return 8 if total > 100 else 4


def print_summary(results: list[dict]) -> None:
    """The table of the variants, then each project / peer ratio and each Float8 / bf16 ratio."""
    ref = {r["variant"].split("-", 1)[1]: r for r in results
           if r["variant"].startswith("reference") and "error" not in r}
    # mem: the allocated peak; rsv: the reserved peak (the only one the peer's own log gives over its steps)
    print(f"{'variant':22s} {'tok/s':>9s} {'TFLOP/s':>8s} {'MFU %':>6s} {'mem GiB':>8s} {'rsv GiB':>8s} "
          f"{'vs ref':>7s}  loss first->last")
    for r in results:
        if "error" in r:
            print(f"{r['variant']:22s} failed")
            continue
        base = ref.get(r["variant"].split("-")[1])
        vs = f"{r['tokens_per_s'] / base['tokens_per_s']:7.3f}" if base else "      -"
        mfu = f"{r['mfu_pct']:6.1f}" if r["mfu_pct"] is not None else "     -"
        mem = f"{r['peak_mem_gib']:8.1f}" if r["peak_mem_gib"] is not None else "       -"
        reserved = r.get("peak_reserved_gib")
        mem += f" {reserved:8.1f}" if reserved is not None else "        -"
        print(f"{r['variant']:22s} {r['tokens_per_s']:9.0f} {r['tflops']:8.1f} {mfu} {mem} {vs}  "
              f"{r['loss_first_last'][0]:.3f} -> {r['loss_first_last'][1]:.3f}")
    ok = {r["variant"]: r for r in results if "error" not in r}
    for mode in ("eager", "compile", "compile-sac"):
        ours, peer = ok.get(f"project-{mode}"), ok.get(f"torchtitan-{mode}")
        if ours and peer:
            print(f"project-{mode} / torchtitan-{mode} ({peer['peer_version']}): "
                  f"{ours['tokens_per_s'] / peer['tokens_per_s']:.3f}x tokens/s, reserved peak "
                  f"{ours.get('peak_reserved_gib') or 0:.1f} vs {peer.get('peak_reserved_gib') or 0:.1f} GiB")
    for r in results:  # Float8 against the same variant in bf16
        base = ok.get(r["variant"].rsplit("-", 1)[0]) if r["variant"].split("-")[-1] in FLOAT8_RECIPES else None
        if base and "error" not in r:
            print(f"{r['variant']} / {base['variant']}: {r['tokens_per_s'] / base['tokens_per_s']:.3f}x tokens/s, "
                  f"peak memory {r['peak_mem_gib'] or 0:.1f} vs {base['peak_mem_gib'] or 0:.1f} GiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--layers", type=int)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="CPU, debug-model dims: tests the script, not a GPU")
    parser.add_argument("--json", help="write all results here")
    parser.add_argument("--peer-site", help="folder holding the `torchtitan` wheel's install: adds the peer's variants")
    parser.add_argument("--float8", action="store_true",
                        help="run " + ",".join(FLOAT8_VARIANTS) + " (bf16 against Float8; needs torchao)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--profile", action="store_true",
                        help="profile two more steps of each project/reference variant: GPU time by kernel class")
    args = parser.parse_args()
    if args.smoke and args.seq == 8192:
        args.seq = 128
    layers = args.layers or (2 if args.smoke else default_layers())
    if args.one:
        print("RESULT " + json.dumps(run_variant(args.one, layers, args.seq, args.steps, args.warmup, args.smoke,
                                                      args.profile)))
        return
    results = []
    if args.float8:
        args.variants = ",".join(FLOAT8_VARIANTS)
    variants = args.variants.split(",") + (PEER_VARIANTS if args.peer_site and args.variants == ",".join(VARIANTS)
                                           else [])
    for variant in variants:
        if variant.startswith("torchtitan"):
            try:
                results.append(run_peer(variant, layers, args.seq, args.steps, args.warmup, args.peer_site))
            except Exception as e:  # noqa: BLE001 - report the peer's failure and go on
                print(f"{variant}: failed\n{e}", file=sys.stderr)
                results.append({"variant": variant, "error": str(e)[-1500:]})
            print(json.dumps(results[-1]), flush=True)
            continue
        cmd = [sys.executable, __file__, "--one", variant, "--layers", str(layers), "--seq", str(args.seq),
               "--steps", str(args.steps), "--warmup", str(args.warmup)] + (["--smoke"] if args.smoke else []) \
            + (["--profile"] if args.profile else [])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            tail = (proc.stdout + proc.stderr)[-3000:]
            print(f"{variant}: failed (exit {proc.returncode})\n{tail}", file=sys.stderr)
            results.append({"variant": variant, "error": tail[-500:]})
            continue
        results.append(json.loads(lines[-1][len("RESULT "):]))
        print(json.dumps(results[-1]), flush=True)
    print_summary(results)
    if results and "device" in results[0]:
        print(f"device: {results[0]['device']}, torch {results[0]['torch']}, {layers} layers, seq {args.seq}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if any("error" in r for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
