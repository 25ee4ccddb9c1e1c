"""Which parameters Muon orthogonalizes, and which stay with AdamW (docs/optimizers.md).

Muon is for the weights that map one hidden space to another: 2-D linear weights and 3-D expert
weights ``[E, m, n]`` (E matrices). AdamW keeps what is a lookup table or a vector: the embeddings,
the output head (its rows are per-token, like the embedding's), the routers (a few rows whose scale
decides the routing), norms, biases and attention sinks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

OUTPUT_HEAD = "output"  # the decoder's head module (models/common/decoder.py)
ROUTER = "router"  # the MoE router module's name (models/moe)


@dataclass
class MuonParams:
    """The two groups, every parameter's name, and the row split of the fused matrices."""

    matrices: list[torch.Tensor] = field(default_factory=list)
    others: list[torch.Tensor] = field(default_factory=list)
    names: dict[torch.Tensor, str] = field(default_factory=dict)
    row_parts: dict[torch.Tensor, tuple[int, ...]] = field(default_factory=dict)


def _kept_for_adamw(model: nn.Module, adamw_fqns: tuple[str, ...]) -> set[torch.Tensor]:
    """The tables and routers, and the parameters whose name holds one of ``adamw_fqns``
    (``--optimizer.muon_adamw_fqns``)."""
    kept: set[torch.Tensor] = set()
    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Embedding) or name == OUTPUT_HEAD or last == ROUTER:
            kept.update(module.parameters())
    kept.update(p for name, p in model.named_parameters() if any(pattern in name for pattern in adamw_fqns))
    return kept


def _row_parts(model: nn.Module, split_heads: bool) -> dict[torch.Tensor, tuple[int, ...]]:
    """The family's fused weights (MLA's ``wkv_a``), each split into its parts' rows, and with ``split_heads``
    the attention's query, key and value projections split into their heads' rows; a module no family built
    (a test's, a user's own) declares none."""
    # Imported here: the launch preflight imports the optimizers, not the models' modules.
    from torchtitan.models.common.decoder import Decoder

    if not isinstance(model, Decoder):
        return {}
    return {**model.fused_row_parts(), **(model.head_row_parts() if split_heads else {})}


def split_params(model_parts: list[nn.Module], *, split_heads: bool = False,
                 adamw_fqns: tuple[str, ...] = ()) -> MuonParams:
    """The matrices of ``model_parts`` for Muon, the rest for AdamW (``split_heads``, ``adamw_fqns``: the
    options ``--optimizer.muon_split_heads`` and ``--optimizer.muon_adamw_fqns``)."""
    out = MuonParams()
    for model in model_parts:
        kept = _kept_for_adamw(model, adamw_fqns)
        out.row_parts.update(_row_parts(model, split_heads))
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            out.names[p] = name
            is_matrix = p.ndim >= 2 and not name.endswith("bias") and p not in kept
            (out.matrices if is_matrix else out.others).append(p)
    return out
