"""Multi-token prediction (DeepSeek-V3 report, §2.2).

Depth k (1..D) predicts the token k + 1 places ahead of each position. Its module combines the
previous depth's hidden state h^{k-1}_i (the main model's last block output for k = 1) with the
embedding of token t_{i+k}: ``h'_i = eh_proj([enorm(Emb(t_{i+k})); hnorm(h^{k-1}_i)])``, runs its own
transformer block on it, and scores ``output(norm(h^k_i))`` against t_{i+k+1}. The embedding and the
output projection are the main model's (shared); ``norm`` is the module's own (a release's
``shared_head.norm``). The loss is ``lambda / D * sum_k L^k``, each ``L^k`` a sum of token
cross-entropies over the main loss's token count T (the report's ``-1/T sum log P``).

Positions are not shortened: depth k's inputs are the tokens rolled k places left, and its last k
positions (whose t_{i+k+1} lies beyond the labels) are not scored. The model returns each depth's logits
with the main ones (``model.py``); the training step scores them (``train_step/mtp.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial

from torchtitan.models.attention import AttentionBackend, DocumentMask
from torchtitan.models.deepseek_v3.args import DeepSeekV3Args
from torchtitan.models.layers import RMSNorm


class MTPModule(nn.Module):
    """One depth: ``forward(h [B, L, dim], emb [B, L, dim], rope_cache, *, backend, documents) -> h^k``."""

    def __init__(self, block: nn.Module, args: DeepSeekV3Args):
        super().__init__()
        self.enorm = RMSNorm(args.dim, args.norm_eps)
        self.hnorm = RMSNorm(args.dim, args.norm_eps)
        self.eh_proj = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.block = block
        self.norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, h: torch.Tensor, emb: torch.Tensor, rope_cache: torch.Tensor, *, backend: AttentionBackend,
                documents: DocumentMask | None = None) -> torch.Tensor:
        x = torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1)
        return self.block(self._project(x), rope_cache, backend=backend, documents=documents)

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        """``eh_proj(x)``. Under sequence parallelism (``x`` a DTensor holding this rank's sequence shard, the
        weight replicated: ``DeepSeekV3Model.extra_tp_plan``) the product runs on the local rows, as DTensor
        would: a DTensor linear flattens ``[B, L/tp, 2·dim]`` to rows, which torch 2.11 refuses with the sequence
        (dimension 1) sharded. The weight's gradient is this rank's partial sum, as DTensor's (summed with the
        other Partial gradients before clipping). Returns a plain tensor, as the blocks hand each other."""
        weight = self.eh_proj.weight
        if not (isinstance(x, DTensor) and isinstance(weight, DTensor)):
            return self.eh_proj(x)
        partial_grad = [Partial() if p.is_replicate() else p for p in weight.placements]
        return F.linear(x.to_local(), weight.to_local(grad_placements=partial_grad))


def depth_tokens(tokens: torch.Tensor, k: int) -> torch.Tensor:
    """The token ids [B, L] whose embeddings depth ``k`` reads: ``tokens`` (the inputs) rolled ``k`` left. The
    last ``k`` positions wrap around; their depth-``k`` targets are not scored (``train_step/mtp.py``), and
    causal attention keeps them from the scored positions."""
    return torch.roll(tokens, -k, dims=1)
