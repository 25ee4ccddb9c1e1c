"""KV-cache bytes per token of the shipped flavors, from ``torchtitan/models/kv_cache_size.py``.

    python benchmarks/kv_cache_bytes.py [--dtype_bytes 2] [--context 131072]

One process, no tensors: the counts come from each flavor's arguments, the same function the tests check
against the cache tensors of tiny models. Columns: what the project's cache holds per token (all layers),
what per-head keys and values would take (MLA's expansion; the same for grouped-query attention), and, at
``--context`` tokens of one sequence, what the cache holds and what it would hold if sliding-window layers
kept only their window (GPT-OSS).
"""

from __future__ import annotations

import argparse

from common import machine_description  # noqa: F401  # puts the repository on the path

from torchtitan.models import model_args
from torchtitan.models.kv_cache_size import cache_bytes, layer_cache_sizes

FLAVORS = [("llama3", "8B"), ("llama3", "70B"), ("llama3", "405B"), ("qwen3", "8B"), ("qwen3", "32B"),
           ("qwen3", "30B-A3B"), ("qwen3", "235B-A22B"), ("deepseek_v3", "16B"), ("deepseek_v3", "671B"),
           ("deepseek_v3", "kimi_k2"), ("gpt_oss", "20b"), ("gpt_oss", "120b")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype_bytes", type=int, default=2, help="bytes per element (2: bf16)")
    parser.add_argument("--context", type=int, default=131072, help="one sequence's tokens for the last columns")
    a = parser.parse_args()
    b, t = a.dtype_bytes, a.context
    print(f"{b} bytes per element; per token: all layers; at {t:,} tokens: one sequence")
    print(f"| model | flavor | layers | values held per token and layer | KiB/token held | KiB/token as per-head "
          f"K and V | GiB at {t // 1024}K held | GiB at {t // 1024}K, windows bounded |")
    print("|---|---|---|---|---|---|---|---|")
    for name, flavor in FLAVORS:
        args = model_args(name, flavor)
        held = sorted({s.held for s in layer_cache_sizes(args)})
        per_token = [cache_bytes(args, 1, b) / 1024, cache_bytes(args, 1, b, expanded=True) / 1024]
        at_context = [cache_bytes(args, t, b) / 2**30, cache_bytes(args, t, b, window_bounded=True) / 2**30]
        print(f"| {name} | {flavor} | {args.n_layers} | {', '.join(map(str, held))} | "
              + " | ".join(f"{x:,.1f}" for x in per_token) + " | " + " | ".join(f"{x:,.2f}" for x in at_context) + " |")


if __name__ == "__main__":
    main()
