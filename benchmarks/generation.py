"""Generation tokens/s on CPU, with the KV cache and with a full recompute per token (benchmarks/README §19).

    python benchmarks/generation.py                        # debug model, prompts of 32 and 256 tokens
    python benchmarks/generation.py --model 8B --n_layers 2 --prompt_lens 64 --new_tokens 16

Random weights (the layout-invariant init), float32, batch of ``--batch`` prompts of random ids; no
end token, so every row runs ``--new_tokens``. A row per (prompt length, path): the prefill (the
prompt's forward and the first token), then the decode rate of the remaining tokens. The 8B shape
keeps its widths, heads and vocabulary; ``--n_layers`` cuts its depth to fit the machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def measure(model, prompt_len: int, new: int, batch: int, use_cache: bool, vocab: int) -> tuple[float, float]:
    """(prefill seconds, decode tokens/s over the whole batch) of one run."""
    import torch

    from torchtitan.generation import Sampling, decode

    prompts = torch.randint(3, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(0)).tolist()
    start = time.perf_counter()
    out = decode(model, prompts, new, Sampling(), stop_ids=[], max_len=prompt_len + new, use_cache=use_cache)
    assert time.perf_counter() - start >= out.prefill_s
    return out.prefill_s, batch * (new - 1) / out.decode_s


def main(argv: list[str] | None = None) -> int:
    import torch

    from torchtitan.models import get_model_spec

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="debugmodel", help="llama3 flavor (default debugmodel; 8B for the 8B shape)")
    p.add_argument("--n_layers", type=int, default=None, help="cut the depth to this many blocks")
    p.add_argument("--prompt_lens", type=int, nargs="+", default=[32, 256])
    p.add_argument("--new_tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = get_model_spec("llama3")
    margs = spec.flavors[args.model]
    margs = dataclasses.replace(margs, n_layers=args.n_layers or margs.n_layers,
                                max_seq_len=max(args.prompt_lens) + args.new_tokens)
    torch.manual_seed(0)
    model = spec.build(margs)
    model.init_weights()
    model.eval()
    n = model.num_params()
    print(f"{args.model}, {margs.n_layers} layers, {n / 1e6:,.0f}M parameters, float32, batch {args.batch}, "
          f"{args.new_tokens} new tokens, {torch.get_num_threads()} threads")
    print(f"{'prompt':>6} | {'path':<17} | {'prefill s':>9} | {'decode tok/s':>12} | {'ms/token':>8}")
    for prompt_len in args.prompt_lens:
        for use_cache in (True, False):
            prefill, rate = measure(model, prompt_len, args.new_tokens, args.batch, use_cache, margs.vocab_size)
            path = "KV cache" if use_cache else "full recompute"
            print(f"{prompt_len:>6} | {path:<17} | {prefill:>9.3f} | {rate:>12.1f} | {1000 * args.batch / rate:>8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
