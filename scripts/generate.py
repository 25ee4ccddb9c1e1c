"""Sample from a checkpoint of this project, a Hugging Face folder or a Meta release.

    python scripts/generate.py outputs/checkpoint --prompt "Once upon a time" --max_new_tokens 32
    python scripts/generate.py llama3_hf --prompts_file prompts.txt --temperature 0.8 --top_p 0.9 --json
    torchrun --nproc_per_node 2 scripts/generate.py outputs/checkpoint/step-100 --prompt "Hi" --max_new_tokens 8

Greedy by default (``--temperature 0``). The prompts run as one left-padded batch with a KV cache;
a row stops at the tokenizer's end token or at ``--max_new_tokens`` (or the model's max_seq_len).
Under ``torchrun`` the model is tensor parallel over all ranks and rank 0 prints. docs/generation.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("path", help="a checkpoint (step-N or its folder), a Hugging Face folder or a Meta release folder")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for a batch)")
    p.add_argument("--prompts_file", type=Path, default=None, help="a file of prompts, one per line")
    p.add_argument("--max_new_tokens", type=int, default=32, help="new tokens per prompt at most (default 32)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    p.add_argument("--top_k", type=int, default=None, help="sample among the k likeliest tokens")
    p.add_argument("--top_p", type=float, default=1.0, help="sample from the nucleus of this probability, in (0, 1]")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object: outputs (tokens, text) and timing")
    p.add_argument("--no_kv_cache", action="store_true", help="recompute the whole sequence at every token")
    p.add_argument("--config", type=Path, default=None, help="a checkpoint's run config (default: the dump folder's)")
    p.add_argument("--tokenizer", default=None, help="tokenizer path (default: the checkpoint's or the folder's)")
    p.add_argument("--model_name", default=None, help="model family of a release folder (default: any that reads it)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="weights' dtype (default: float32 on CPU, bfloat16 on CUDA)")
    return p.parse_args(argv)


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts_file is not None:
        if not args.prompts_file.is_file():
            raise ValueError(f"--prompts_file={args.prompts_file}: no such file")
        prompts += [line for line in args.prompts_file.read_text().splitlines() if line.strip()]
    return prompts


def run(args: argparse.Namespace) -> dict:
    import torch

    from torchtitan.distributed import device_type, init_distributed
    from torchtitan.generation import Sampling, describe, generate, load, prompt_ids

    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    problems = sampling.problems()
    if problems:  # before anything is read or any process group made
        raise ValueError("; ".join(problems))
    source = describe(args.path, config=args.config, tokenizer_path=args.tokenizer, model_name=args.model_name)
    prompts = read_prompts(args)
    prompt_ids(source, prompts)  # its one-line refusals, on every rank before any collective
    tp_mesh = None
    device = torch.device(device_type())
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from torch.distributed.device_mesh import init_device_mesh

        _, world, device = init_distributed(300)
        tp_mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))
    elif device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    loaded = load(source, device=device, dtype=dtype, tp_mesh=tp_mesh)
    outputs, timing = generate(loaded, prompts, args.max_new_tokens, sampling, use_cache=not args.no_kv_cache)
    return {"outputs": [{"prompt": o.prompt, "prompt_tokens": o.prompt_tokens, "tokens": o.tokens, "text": o.text}
                        for o in outputs],
            "timing": timing, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
            "tensor_parallel": tp_mesh.size() if tp_mesh is not None else 1, "kv_cache": not args.no_kv_cache}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    ok = False
    try:
        result = run(args)
        ok = True
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        # The trainer's ending: meet the peers, destroy the groups and collect them now. A gloo group
        # left to the interpreter's exit can abort the process ("terminate called without an active
        # exception"), which failed a CI run.
        from torchtitan.distributed.lifecycle import shutdown_distributed

        shutdown_distributed(ok=ok, timeout_seconds=60)
    if int(os.environ.get("RANK", "0")) == 0:
        if args.json:
            print(json.dumps(result))
        else:
            for out in result["outputs"]:
                print(out["prompt"] + out["text"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
