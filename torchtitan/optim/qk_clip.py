"""QK-clip, the "Clip" of ``--optimizer.name MuonClip`` (docs/optimizers.md, "QK-clip (MuonClip)").

Every step, after the optimizer's:

1. each attention module's ``max_logits`` buffer (models/attention/max_logit.py) holds its heads' largest
   pre-softmax logit over this rank's forwards of the step;
2. every rank writes its own into a table ``[attention modules of the whole model, heads]`` (its pipeline
   stage's rows, its tensor-parallel heads at their global index, -inf elsewhere), and one all-reduce (MAX)
   over the world makes it the maximum over the whole global batch and sequence, the same on every rank;
3. head ``h`` of a module whose maximum ``S_h`` exceeds the threshold ``tau`` has its query/key weights
   scaled so that its logits scale by ``gamma_h = tau / S_h`` (each module's ``clip_row_scales``); the
   rows are scaled on each rank's own shard of the (DTensor) weights, located by their global offset, with no
   further collective.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from torchtitan.compat.mesh import local_shape_and_global_offset
from torchtitan.models.attention.max_logit import QKClipped, take, watch

logger = logging.getLogger(__name__)

# Framework wrappers that may sit between a block and its attention in a module name.
_WRAPPER_NAMES = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def attention_names(model: nn.Module) -> list[str]:
    """The names of the attention modules QK-clip takes (grouped-query attention and MLA), in module order: the
    rows of the table. From the whole model, so every pipeline stage numbers the rows alike."""
    return [_plain_name(name) for name, module in model.named_modules()
            if isinstance(module, QKClipped)]


def _plain_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_NAMES)


def clip_factors(maxima: torch.Tensor, threshold: float) -> torch.Tensor:
    """``gamma = min(1, tau / S)`` per head (1 where a head was not measured, ``S`` = -inf)."""
    return torch.where(maxima > threshold, threshold / maxima, torch.ones_like(maxima))


@dataclass(frozen=True)
class ShardRows:
    """A weight (or bias) and the global rows ``[start, stop)`` of this rank's shard: FSDP2 and column-wise TP cut
    whole rows, and their offset comes from the placements. Found once, at set-up: the scaling after each step
    then needs neither a collective nor the mesh (the planner's dry run steps on fake tensors)."""

    param: torch.Tensor
    start: int
    stop: int

    @staticmethod
    def of(param: torch.Tensor) -> ShardRows:
        if isinstance(param, DTensor):
            shape, offset = local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
            return ShardRows(param, offset[0], offset[0] + shape[0])
        return ShardRows(param, 0, param.shape[0])

    @torch.no_grad()
    def scale(self, row_scale: torch.Tensor) -> None:
        """Multiply the shard's rows by their factors in ``row_scale`` (one per global row), in place."""
        local = self.param.to_local() if isinstance(self.param, DTensor) else self.param
        part = row_scale[self.start: self.stop].to(local.dtype)
        local.mul_(part if local.ndim == 1 else part.unsqueeze(-1))  # a bias, or a weight's rows


@dataclass
class WatchedAttention:
    """One attention module of this rank: its table row, where its heads start among the model's, and the shards
    of the parameters its clip scales (``QKClipped.clip_row_scales``, in that order)."""

    row: int
    module: QKClipped
    first_head: int  # under TP: this rank's heads are [first_head, first_head + local heads)
    shards: list[ShardRows]

    @staticmethod
    def of(row: int, module: QKClipped, first_head: int) -> WatchedAttention:
        ones = torch.ones(module.clip_heads())
        return WatchedAttention(row, module, first_head,
                                [ShardRows.of(param) for param, _ in module.clip_row_scales(ones)])

    def clip(self, gamma: torch.Tensor) -> None:
        """Scale this module's weights by the whole model's per-head factors ``gamma`` [heads]."""
        for shard, (_, row_scale) in zip(self.shards, self.module.clip_row_scales(gamma), strict=True):
            shard.scale(row_scale)


class QKClip:
    """Measures, reduces and clips (see the module docstring); ``step()`` runs after each optimizer step."""

    def __init__(self, model_parts: list[nn.Module], rows: list[str], heads: int, threshold: float,
                 tp_mesh: DeviceMesh | None = None):
        if threshold <= 0:
            raise ValueError(f"optimizer.qk_clip_threshold must be positive, got {threshold}")
        self.threshold, self.heads, self.rows = threshold, heads, rows
        tp_rank, tp_size = (tp_mesh.get_local_rank(), tp_mesh.size()) if tp_mesh is not None else (0, 1)
        index = {name: i for i, name in enumerate(rows)}
        self.watched: list[WatchedAttention] = []
        for part in model_parts:
            for name, module in part.named_modules():
                if not isinstance(module, QKClipped):
                    continue
                refusal = module.clip_refusal()
                if refusal:
                    raise ValueError(f"optimizer.name=MuonClip: {name}: {refusal}; use --optimizer.name Muon")
                watch(module, heads // tp_size, next(module.parameters()).device)
                self.watched.append(WatchedAttention.of(index[_plain_name(name)], module, tp_rank * heads // tp_size))
        self.last: torch.Tensor | None = None  # the last step's reduced table [rows, heads]

    def measured(self, device: torch.device) -> torch.Tensor:
        """This rank's table: its modules' maxima at their rows and global heads, -inf elsewhere."""
        table = torch.full((len(self.rows), self.heads), float("-inf"), device=device)
        for w in self.watched:
            found = take(w.module)
            table[w.row, w.first_head: w.first_head + found.numel()] = found
        return table

    @torch.no_grad()
    def step(self) -> None:
        device = next(self.watched[0].module.parameters()).device if self.watched else torch.device("cpu")
        table = self.measured(device)
        if dist.is_initialized() and dist.get_world_size() > 1:  # the one collective of the clip
            dist.all_reduce(table, op=dist.ReduceOp.MAX)
        self.last = table
        gamma = clip_factors(table, self.threshold)
        for w in self.watched:
            w.clip(gamma[w.row])

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        """``register_step_post_hook``'s signature."""
        del optimizer, args, kwargs
        self.step()


def heads_of(module: nn.Module) -> int:
    """The query heads of a whole (unsharded, possibly meta) attention module."""
    assert isinstance(module, QKClipped)
    return module.clip_heads()
