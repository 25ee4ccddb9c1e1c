"""Muon: momentum orthogonalized by Newton-Schulz for the matrices, AdamW for the rest (docs/optimizers.md).

One optimizer, two parameter groups: ``use_muon=True`` holds the matrices (2-D weights, and 3-D expert
weights ``[E, m, n]`` as E matrices), ``use_muon=False`` the rest (embeddings, the output head, routers,
norms, biases, sinks). Its state is the standard torch one (``momentum_buffer`` for a matrix;
``step``, ``exp_avg``, ``exp_avg_sq`` for an AdamW parameter), so DCP saves and loads it like AdamW's.

Sharded matrices (DTensors of FSDP2, HSDP, DDP, TP, EP and their mixes) are orthogonalized once each, by an owner rank
(``muon_owners.py``); the update equals one process's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam

if TYPE_CHECKING:
    from torchtitan.config.job_config import Optimizer as OptimizerConfig

# The quintic iteration's coefficients of the published recipe: they push every singular value
# of the normalized matrix towards [0.7, 1.2] in five steps (not exactly 1: speed over precision).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# 0.2 * sqrt(max(m, n)) gives the orthogonalized update about the RMS of an AdamW update (Moonlight),
# so AdamW's learning rate and weight decay carry over.
ADAMW_RMS = 0.2
UPDATE_SCALES = ("match_adamw_rms", "shape_ratio")
# The optimizer names that train the matrices with Muon: MuonClip is Muon, then QK-clip after each step.
MUON_OPTIMIZERS = ("Muon", "MuonClip")


@dataclass(frozen=True)
class MuonSettings:
    """How a matrix's update is made from its momentum."""

    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    ns_dtype: str = "bfloat16"  # a key of NS_DTYPES
    update_scale: str = "match_adamw_rms"  # one of UPDATE_SCALES
    # Which parameters and parts it takes (muon_params.py): the attention's heads apart, and the names sent to AdamW.
    split_heads: bool = False
    adamw_fqns: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, o: OptimizerConfig) -> MuonSettings:
        return cls(o.muon_momentum, o.muon_nesterov, o.muon_ns_steps, o.muon_ns_dtype, o.muon_update_scale,
                   o.muon_split_heads, tuple(o.muon_adamw_fqns))


def newton_schulz(matrices: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """The approximate orthogonal factor ``U V^T`` of each matrix of ``[..., m, n]``, in ``dtype``.

    The iteration works on the wide orientation (m <= n), where ``X X^T`` is the small product.
    """
    a, b, c = NS_COEFFICIENTS
    x = matrices.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    # Frobenius normalization bounds the spectral norm by 1, inside the iteration's basin.
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


def update_scale(rows: int, cols: int, rule: str) -> float:
    if rule == "match_adamw_rms":
        return ADAMW_RMS * math.sqrt(max(rows, cols))
    if rule == "shape_ratio":
        return math.sqrt(max(1.0, rows / cols))
    raise ValueError(f"optimizer.muon_update_scale must be one of {', '.join(UPDATE_SCALES)}, got {rule!r}")


def orthogonalized(full: torch.Tensor, row_parts: tuple[int, ...], settings: MuonSettings) -> torch.Tensor:
    """The scaled update of one whole weight ``[m, n]`` or ``[E, m, n]`` from its (Nesterov) momentum.

    ``row_parts`` splits the rows of a fused weight into the matrices it concatenates; each part is
    orthogonalized and scaled on its own (empty: the weight is one matrix). Parts that repeat a pattern (the
    heads of ``--optimizer.muon_split_heads``) go through the iteration as one batch per kind of part.
    """
    pattern, repeats = _period(row_parts)
    if repeats > 1:
        per_repeat = full.unflatten(-2, (repeats, sum(pattern)))
        return orthogonalized(per_repeat, pattern, settings).flatten(-3, -2)
    parts = full.split(list(row_parts), dim=-2) if row_parts else (full,)
    out = []
    for part in parts:
        o = newton_schulz(part, settings.ns_steps, NS_DTYPES[settings.ns_dtype])
        out.append(o.to(full.dtype) * update_scale(part.size(-2), part.size(-1), settings.update_scale))
    return torch.cat(out, dim=-2) if len(out) > 1 else out[0]


def _period(row_parts: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    """The shortest pattern ``row_parts`` repeats, and how many times (1: no repetition)."""
    n = len(row_parts)
    for length in range(1, n // 2 + 1):
        if n % length == 0 and row_parts == row_parts[:length] * (n // length):
            return row_parts[:length], n // length
    return row_parts, 1


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's storage of ``t`` (in-place updates of it update the DTensor)."""
    return t.to_local() if isinstance(t, DTensor) else t


# (whole momentum updates, settings, row parts by parameter) -> scaled updates; muon_owners.py's
# OwnerUpdate is the distributed one.
Orthogonalize = Callable[[list[torch.Tensor], list[torch.Tensor], MuonSettings, list[tuple[int, ...]]],
                         list[torch.Tensor]]


def orthogonalize_locally(params: list[torch.Tensor], updates: list[torch.Tensor], settings: MuonSettings,
                          row_parts: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """One process (or replicated plain tensors): each update is the whole matrix already."""
    del params
    return [orthogonalized(u, parts, settings) for u, parts in zip(updates, row_parts)]


class Muon(torch.optim.Optimizer):
    """Muon for ``matrices``, AdamW for ``others``; ``row_parts`` maps a fused matrix to its row split."""

    def __init__(self, matrices: list[torch.Tensor], others: list[torch.Tensor], *, lr: float,
                 weight_decay: float, betas: tuple[float, float], eps: float, settings: MuonSettings,
                 row_parts: dict[torch.Tensor, tuple[int, ...]] | None = None,
                 orthogonalize: Orthogonalize | None = None) -> None:
        if lr <= 0:
            raise ValueError(f"optimizer.lr must be positive for Muon, got {lr}")
        if settings.ns_steps < 1:
            raise ValueError(f"optimizer.muon_ns_steps must be at least 1, got {settings.ns_steps}")
        if settings.ns_dtype not in NS_DTYPES:
            raise ValueError(f"optimizer.muon_ns_dtype must be one of {', '.join(NS_DTYPES)}, "
                             f"got {settings.ns_dtype!r}")
        update_scale(1, 1, settings.update_scale)  # refuses an unknown rule
        groups = [
            {"params": matrices, "use_muon": True, "momentum": settings.momentum, "nesterov": settings.nesterov},
            {"params": others, "use_muon": False, "betas": betas, "eps": eps},
        ]
        super().__init__([g for g in groups if g["params"]], {"lr": lr, "weight_decay": weight_decay})
        self.settings = settings
        self.row_parts = dict(row_parts or {})
        self.orthogonalize: Orthogonalize = orthogonalize or orthogonalize_locally

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_step(group)
            else:
                self._adamw_step(group)
        return loss

    def _muon_step(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        momentum, updates = group["momentum"], []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buf, grad = local(state["momentum_buffer"]), local(p.grad)
            buf.mul_(momentum).add_(grad)
            updates.append(grad.add(buf, alpha=momentum) if group["nesterov"] else buf.clone())
        settings = dataclasses.replace(self.settings, momentum=momentum, nesterov=group["nesterov"])
        parts = [self.row_parts.get(p, ()) for p in params]
        lr, decay = group["lr"], group["lr"] * group["weight_decay"]
        for p, update in zip(params, self.orthogonalize(params, updates, settings, parts)):
            weight = local(p)
            weight.mul_(1 - decay)
            weight.add_(update, alpha=-lr)

    def _adamw_step(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
        # The foreach kernel takes one tensor kind per call: DTensors and plain tensors apart.
        for kind in (True, False):
            chosen = [p for p in params if isinstance(p, DTensor) == kind]
            if not chosen:
                continue
            adam(
                chosen, [p.grad for p in chosen], [self.state[p]["exp_avg"] for p in chosen],
                [self.state[p]["exp_avg_sq"] for p in chosen], [], [self.state[p]["step"] for p in chosen],
                foreach=True, decoupled_weight_decay=True, amsgrad=False, beta1=group["betas"][0],
                beta2=group["betas"][1], lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                maximize=False)
