"""A training step of the MoE debug model against a dense model with the same active parameters, on CPU.

    python benchmarks/moe_step.py [--batch 4] [--seq_len 256] [--warmup 3] [--steps 10]

One process, one thread, float32. The MoE model is Qwen3's ``debugmodel_moe`` (4 layers, layer 0
dense with width 512, layers 1-3 with 8 experts of width 128, top-2). Its dense counterpart is the
same decoder with every sparse feed-forward replaced by one SwiGLU of width top_k x 128 = 256: a
token meets the same number of feed-forward weights in both, so the two have the same active
parameters (``param_counts``) but for the MoE's routers (dim x experts per sparse layer).

A step is what the trainer does per optimizer step: forward, cross-entropy, backward, AdamW step,
zeroing the gradients. Both models get the CPU kernels ``train.py`` installs (oneDNN linears, the
attention kernel). The steps alternate between the two models, so load on the machine falls on
both alike; the figure is the median after ``--warmup`` steps of each.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
import torch.nn.functional as F
from common import load_average, machine_description

from torchtitan.distributed.layout_init import init_params_layout_invariant
from torchtitan.models import model_args
from torchtitan.models.common.args import MoEDecoderArgs
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.common.flops import flops_per_token, param_counts
from torchtitan.models.common.parallel import use_attention
from torchtitan.models.layers import FeedForward
from torchtitan.ops.cpu_kernels import use_onednn_linears


def dense_counterpart(moe_args: MoEDecoderArgs) -> tuple[MoEDecoderArgs, dict[int, int]]:
    """(dense args, per-layer feed-forward width): sparse layers get width top_k * moe_hidden_size.

    ``MoEDecoderArgs`` has one dense width, so the args carry the sparse layers' width and the map
    gives the layers (the MoE model's dense ones) whose width differs.
    """
    active_width = moe_args.top_k * moe_args.moe_hidden_size
    dense = dataclasses.replace(moe_args, num_experts=0, ffn_hidden_size=active_width, mlp_only_layers=())
    widths = {i: moe_args.ffn_hidden_size for i in range(moe_args.n_layers) if not moe_args.is_moe_layer(i)}
    return dense, widths


def _width_correction(dense: MoEDecoderArgs, widths: dict[int, int]) -> int:
    """Parameters the layers of another width add to the dense args' count (3 * dim per unit of width)."""
    return sum(3 * dense.dim * (w - dense.ffn_hidden_size) for w in widths.values())


def dense_active_params(dense: MoEDecoderArgs, widths: dict[int, int]) -> int:
    """``param_counts`` of the dense args, corrected for the layers of another width."""
    return param_counts(dense)[1] + _width_correction(dense, widths)


def dense_flops_per_token(dense: MoEDecoderArgs, widths: dict[int, int], seq_len: int) -> float:
    """``flops_per_token`` of the dense args, corrected likewise (6 FLOPs per parameter and token)."""
    return flops_per_token(dense, seq_len) + 6.0 * _width_correction(dense, widths)


def build(args: MoEDecoderArgs, widths: dict[int, int], seed: int) -> Decoder:
    model = Decoder(args)
    for i, width in widths.items():
        model.layers[str(i)].feed_forward = FeedForward(args.dim, width)
    init_params_layout_invariant(model, seed)
    model.init_buffers()
    use_onednn_linears(model)  # as train.py on CPU (cpu_matmul=onednn), with its attention backend
    use_attention(model, "auto", "cpu", None, args.max_seq_len)
    return model.train()


def step(model: Decoder, optimizer: torch.optim.Optimizer, tokens: torch.Tensor, labels: torch.Tensor
         ) -> tuple[float, float]:
    """One optimizer step: (seconds of forward + backward, seconds of the AdamW step and zeroing)."""
    start = time.perf_counter()
    logits = model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    loss.backward()
    middle = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return middle - start, time.perf_counter() - middle


def describe(moe_args: MoEDecoderArgs, dense_args: MoEDecoderArgs, widths: dict[int, int], dense: Decoder,
             seq_len: int) -> None:
    """Print both models' parameter and FLOP counts; raise if the dense model built is not the one counted."""
    moe_total, moe_active = param_counts(moe_args)
    dense_params = sum(p.numel() for p in dense.parameters())
    if dense_params != dense_active_params(dense_args, widths):
        raise RuntimeError(f"dense counterpart: {dense_params} parameters built, the count says "
                           f"{dense_active_params(dense_args, widths)}")
    router = sum(moe_args.dim * moe_args.num_experts for i in range(moe_args.n_layers) if moe_args.is_moe_layer(i))
    print(f"MoE:   {moe_total:,} parameters, {moe_active:,} active per token (param_counts)")
    print(f"dense: {dense_params:,} parameters, all active; MoE active - dense = {moe_active - dense_params:,} "
          f"(the routers: {router:,})")
    moe_flops, dense_flops = flops_per_token(moe_args, seq_len), dense_flops_per_token(dense_args, widths, seq_len)
    print(f"training FLOPs per token at seq {seq_len} (flops_per_token): MoE {moe_flops:.5g}, dense {dense_flops:.5g}")


def time_steps(models: dict[str, Decoder], batch: int, seq_len: int, warmup: int, steps: int
               ) -> dict[str, list[tuple[float, float]]]:
    """(ms forward + backward, ms optimizer) per step of each model, ``steps`` after ``warmup``, the
    models taking turns step by step."""
    vocab = next(iter(models.values())).args.vocab_size
    data = torch.randint(0, vocab, (batch, seq_len + 1), generator=torch.Generator().manual_seed(0))
    tokens, labels = data[:, :-1], data[:, 1:]
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=True) for name, m in models.items()}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in models}
    for i in range(warmup + steps):
        for name, model in models.items():
            compute, update = step(model, optimizers[name], tokens, labels)
            if i >= warmup:
                times[name].append((compute * 1e3, update * 1e3))
    return times


def main() -> None:
    args = step_options(__doc__)
    moe_args = dataclasses.replace(model_args("qwen3", "debugmodel_moe"), max_seq_len=args.seq_len)
    dense_args, widths = dense_counterpart(moe_args)
    models = {"MoE (debugmodel_moe)": build(moe_args, {}, 0), "dense, same active": build(dense_args, widths, 0)}
    print(f"{machine_description()}; load average {load_average()}")
    describe(moe_args, dense_args, widths, models["dense, same active"], args.seq_len)
    times = time_steps(models, args.batch, args.seq_len, args.warmup, args.steps)
    print_ratio("MoE / dense", times, args)


def step_options(doc: str | None, flags: dict[str, str] | None = None) -> argparse.Namespace:
    """The command line of a step-time comparison (batch, sequence, warm-up and timed steps, and the caller's
    on/off ``flags`` with their help); one thread from here."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, text in (flags or {}).items():
        parser.add_argument(flag, action="store_true", help=text)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    return args


def print_ratio(title: str, times: dict[str, list[tuple[float, float]]], args: argparse.Namespace) -> None:
    """A row of step times per model (``time_steps``' two), then the first's median and minimum over the second's."""
    print(f"batch {args.batch} x seq {args.seq_len} = {args.batch * args.seq_len} tokens; float32, one thread; "
          f"median of {args.steps} steps after {args.warmup} warm-up; ms")
    width = max(len(name) for name in times)
    print(f"{'':>{width}} {'step':>8} {'min':>8} {'max':>8} {'fwd+bwd':>8} {'AdamW':>8}")
    medians, minima = {}, {}
    for name, t in times.items():
        whole = [a + b for a, b in t]
        medians[name], minima[name] = statistics.median(whole), min(whole)
        print(f"{name:>{width}} {medians[name]:8.1f} {min(whole):8.1f} {max(whole):8.1f} "
              f"{statistics.median(a for a, _ in t):8.1f} {statistics.median(b for _, b in t):8.1f}")
    first, second = list(times)
    # The minima too: on a loaded machine they are the steps least disturbed.
    print(f"{title}: {medians[first] / medians[second]:.2f} (medians), {minima[first] / minima[second]:.2f} (minima); "
          f"load average after {load_average()}")


if __name__ == "__main__":
    main()
