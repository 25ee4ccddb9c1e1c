"""The decoding loop: a batch of prompts of different lengths, left-padded, with or without a KV cache.

With the cache (``models/kv_cache.py``) the prompts run through the model once (prefill) and
every later forward takes one new token per row. Without it, every step recomputes the whole
sequence so far: the same attention code on a fresh cache, so the two agree and only the cost
differs (the benchmark and the tests compare them).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from torchtitan.generation.sampling import Sampling, next_tokens
from torchtitan.models.kv_cache import KVCache


@dataclass
class Decoded:
    """New tokens per row (up to and including an end token), and where the time went."""

    tokens: list[list[int]]
    prefill_s: float = 0.0
    decode_s: float = 0.0
    steps: int = 0  # forwards after the prefill
    finished: list[bool] = field(default_factory=list)  # the row ended at an end token


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, longest] ids, each row right-aligned; [B] padding count per row."""
    longest = max(len(p) for p in prompts)
    pad = torch.tensor([longest - len(p) for p in prompts], device=device)
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
    return ids, pad


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def decode(model: nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int, sampling: Sampling, *,
           stop_ids: Sequence[int], max_len: int, use_cache: bool = True, pad_id: int = 0) -> Decoded:
    """Continue every prompt by at most ``max_new_tokens`` tokens, stopping a row at one of ``stop_ids``.

    ``max_len``: the longest sequence the model takes (its ``max_seq_len``); rows stop there too.
    """
    device = next(model.parameters()).device
    ids, pad = left_pad(prompts, pad_id, device)
    steps = min(max_new_tokens, max_len - ids.shape[1])
    generator = torch.Generator(device=device).manual_seed(sampling.seed)
    stop = torch.tensor(list(stop_ids), dtype=torch.long, device=device)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    out = Decoded(tokens=[[] for _ in prompts])
    cache = KVCache(pad, ids.shape[1] + steps)
    _sync(device)
    start = time.perf_counter()
    step_input = ids
    for step in range(steps):
        if not use_cache:  # a full recompute: the whole sequence so far, on a fresh cache
            cache = KVCache(pad, ids.shape[1])
            step_input = ids
        token = next_tokens(model(step_input, cache=cache)[:, -1], sampling, generator)
        token = torch.where(done, pad_id, token)  # a finished row only pads
        for row, value in enumerate(token.tolist()):
            if not done[row]:
                out.tokens[row].append(value)
        done |= torch.isin(token, stop)
        ids = torch.cat([ids, token[:, None]], dim=1)
        step_input = token[:, None]
        if step == 0:
            _sync(device)
            out.prefill_s = time.perf_counter() - start
        if bool(done.all()):
            break
    _sync(device)
    out.decode_s = time.perf_counter() - start - out.prefill_s
    out.steps = max(len(t) for t in out.tokens) - 1 if out.tokens else 0
    out.finished = done.tolist()
    return out
