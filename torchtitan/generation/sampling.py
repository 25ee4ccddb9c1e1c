"""Choosing the next token from logits: greedy, or temperature with top-k and top-p, seeded."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen. ``temperature`` 0 is greedy (top-k and top-p then do nothing)."""

    temperature: float = 0.0
    top_k: int | None = None  # keep the k likeliest tokens; None or 0: all
    top_p: float = 1.0  # keep the smallest set of likeliest tokens whose probability reaches top_p
    seed: int = 0

    def problems(self) -> list[str]:
        """One line per bad value, naming the option and what it takes."""
        out = []
        if not self.temperature >= 0.0:
            out.append(f"--temperature={self.temperature}: use 0 (greedy) or a positive temperature")
        if self.top_k is not None and self.top_k < 0:
            out.append(f"--top_k={self.top_k}: use a positive number of tokens (0: all)")
        if not 0.0 < self.top_p <= 1.0:
            out.append(f"--top_p={self.top_p}: must lie in (0, 1] (1: all tokens)")
        return out


def filter_logits(logits: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    """``logits`` [B, V] with every token outside the top-k and the top-p nucleus set to -inf."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        # A token is dropped when the likelier ones already reach top_p; the likeliest always stays.
        drop = probs.cumsum(dim=-1) - probs >= top_p
        drop[:, 0] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def next_tokens(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """The next token of each row [B] from its last logits [B, V] (in float32)."""
    logits = logits.float()
    if sampling.temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = filter_logits(logits / sampling.temperature, sampling.top_k, sampling.top_p)
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)
