"""A training step with multi-head latent attention (MLA) against grouped-query attention (GQA) at equal
parameters, on CPU.

    python benchmarks/mla_vs_gqa.py [--batch 4] [--seq_len 256] [--warmup 3] [--steps 10] [--kernels]

With ``--kernels`` it also times the causal SDPA call alone at both models' head sizes (and at MLA's with
the value head padded to the query/key head), forward and backward, after the steps.

One process, one thread, float32, causal mask. Both models are the same dense decoder (DeepSeek-V3's
``debugmodel`` widths: dim 256, 4 layers, SwiGLU 512, vocabulary 2048, every layer dense) and differ only in
their attention:

- MLA: the debug model's own (8 heads, query LoRA 96, latent 64, q/k head 32 + 16 rotary, value head 24):
  159,904 parameters per layer;
- GQA: 8 query heads and 4 key/value heads of 26 (no query/key norm): 159,744 per layer, the nearest a
  grouped-query layout comes (0.1% fewer).

A step is forward, cross-entropy, backward, AdamW step and zeroing. Both models get the CPU kernels
``train.py`` installs (oneDNN linears, the attention backend). The steps alternate between the two models,
so load on the machine falls on both alike; the figure is the median after ``--warmup`` steps of each.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.nn.functional as F
from common import load_average, machine_description
from moe_step import build as build_decoder
from moe_step import print_ratio, step_options, time_steps

from torchtitan.distributed.layout_init import init_params_layout_invariant
from torchtitan.models import model_args
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.common.parallel import use_attention
from torchtitan.models.deepseek_v3.args import DeepSeekV3Args
from torchtitan.models.deepseek_v3.model import DeepSeekV3Model
from torchtitan.models.mixtral.args import MixtralArgs
from torchtitan.ops.cpu_kernels import use_onednn_linears

GQA_HEADS, GQA_KV_HEADS, GQA_HEAD_DIM = 8, 4, 26


def mla_args(seq_len: int) -> DeepSeekV3Args:
    """DeepSeek-V3's debug model, every layer dense (the feed-forward is the dense SwiGLU of the GQA model)."""
    debug = model_args("deepseek_v3", "debugmodel")
    assert isinstance(debug, DeepSeekV3Args)
    return dataclasses.replace(debug, first_k_dense_replace=debug.n_layers, max_seq_len=seq_len,
                               attn_mask_type="causal")


def gqa_args(mla: DeepSeekV3Args) -> MixtralArgs:
    """The same decoder with grouped-query attention of (nearly) the same parameters: Mixtral's arguments
    (grouped-query attention without a query/key norm), no experts."""
    return MixtralArgs(dim=mla.dim, n_layers=mla.n_layers, n_heads=GQA_HEADS, n_kv_heads=GQA_KV_HEADS,
                       head_dim=GQA_HEAD_DIM, vocab_size=mla.vocab_size, ffn_hidden_size=mla.ffn_hidden_size,
                       norm_eps=mla.norm_eps, rope_theta=mla.rope_theta, max_seq_len=mla.max_seq_len,
                       attn_mask_type="causal")


def build_mla(args: DeepSeekV3Args, seed: int) -> Decoder:
    model = DeepSeekV3Model(args)
    init_params_layout_invariant(model, seed)
    model.init_buffers()
    use_onednn_linears(model)  # as train.py on CPU (cpu_matmul=onednn), with its attention backend
    use_attention(model, "auto", "cpu", None, args.max_seq_len)
    return model.train()


def time_sdpa(batch: int, seq_len: int, repeats: int = 5) -> None:
    """Causal SDPA forward + backward at the two models' head sizes, ms per call (the median of ``repeats``)."""
    shapes = {"MLA (q/k 48, v 24)": (GQA_HEADS, 48, 24), "MLA, v padded to 48": (GQA_HEADS, 48, 48),
              "GQA (q/k/v 26)": (GQA_HEADS, GQA_HEAD_DIM, GQA_HEAD_DIM)}
    for name, (heads, qk, v) in shapes.items():
        q, k = (torch.randn(batch, heads, seq_len, qk, requires_grad=True) for _ in range(2))
        values = torch.randn(batch, heads, seq_len, v, requires_grad=True)
        times = []
        for _ in range(repeats + 1):  # the first call warms up
            start = time.perf_counter()
            F.scaled_dot_product_attention(q, k, values, is_causal=True).sum().backward()
            times.append((time.perf_counter() - start) * 1e3)
        print(f"SDPA alone, {name}: {sorted(times[1:])[repeats // 2]:.1f} ms")


def describe(models: dict[str, Decoder]) -> None:
    """Each model's attention and total parameters, counted on the built modules."""
    for name, model in models.items():
        total = sum(p.numel() for p in model.parameters())
        attention = sum(p.numel() for p in model.layers["0"].attention.parameters())
        print(f"{name:>6}: {attention:,} attention parameters per layer ({model.args.attention()}); {total:,} in all")


def main() -> None:
    args = step_options(__doc__, flags={"--kernels": "also time the causal SDPA call alone at both head sizes"})
    mla = mla_args(args.seq_len)
    models = {"MLA": build_mla(mla, 0), "GQA": build_decoder(gqa_args(mla), {}, 0)}
    print(f"{machine_description()}; load average {load_average()}")
    describe(models)
    times = time_steps(models, args.batch, args.seq_len, args.warmup, args.steps)
    print_ratio("MLA / GQA", times, args)
    if args.kernels:
        time_sdpa(args.batch, args.seq_len)


if __name__ == "__main__":
    main()
