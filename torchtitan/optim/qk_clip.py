"""QK-clip, the "Clip" of ``--optimizer.name MuonClip`` (docs/optimizers.md, "QK-clip (MuonClip)").

Every step, after the optimizer's:

1. each attention module's ``max_logits`` buffer (models/attention/max_logit.py) holds its heads' largest
   pre-softmax logit over this rank's forwards of the step;
2. every rank writes its own into a table ``[attention modules of the whole model, heads]`` (its pipeline
   stage's rows, its tensor-parallel heads at their global index, -inf elsewhere), and one all-reduce (MAX)
   over the world makes it the maximum over the whole global batch and sequence, the same on every rank;
3. head ``h`` of a module whose maximum ``S_h`` exceeds the threshold ``tau`` has its query/key weights
   scaled so that its logits scale by ``gamma_h = tau / S_h`` (``gqa_row_scales``, ``mla_row_scales``); the
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
from torchtitan.models.attention.gqa import GroupedQueryAttention
from torchtitan.models.attention.max_logit import take, watch
from torchtitan.models.deepseek_v3.mla import MultiHeadLatentAttention

logger = logging.getLogger(__name__)

# Framework wrappers that may sit between a block and its attention in a module name.
_WRAPPER_NAMES = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def attention_names(model: nn.Module) -> list[str]:
    """The names of the attention modules QK-clip takes (grouped-query attention and MLA), in module order: the
    rows of the table. From the whole model, so every pipeline stage numbers the rows alike."""
    return [_plain_name(name) for name, module in model.named_modules()
            if isinstance(module, (GroupedQueryAttention, MultiHeadLatentAttention))]


def _plain_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_NAMES)


def clip_factors(maxima: torch.Tensor, threshold: float) -> torch.Tensor:
    """``gamma = min(1, tau / S)`` per head (1 where a head was not measured, ``S`` = -inf)."""
    return torch.where(maxima > threshold, threshold / maxima, torch.ones_like(maxima))


def gqa_row_scales(gamma: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The factor of each row of ``wq`` (``[heads * head_dim]``): head ``h``'s query rows by ``gamma_h``.

    Why the queries alone: a key head is shared by its query group, so scaling a key would move the logits of
    every head of the group, those under the threshold too. Scaling head ``h``'s query rows scales its logits by
    exactly ``gamma_h`` and leaves every other head's weights bitwise as they are (a factor of 1 is exact).
    """
    return gamma.repeat_interleave(head_dim)


def mla_row_scales(gamma: torch.Tensor, nope: int, rope: int, v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The row factors of MLA's query projection (``[heads * (nope + rope)]``) and of ``wkv_b``
    (``[heads * (nope + v_dim)]``): the logit ``q_nope . k_nope + q_rope . k_rope`` scales by ``gamma`` when the
    compressed query and key parts take ``sqrt(gamma)`` each and the rotary query ``gamma``; the rotary key is
    shared by every head (in ``wkv_a``) and the values do not enter the logit, so both stay as they are."""
    root = gamma.sqrt().unsqueeze(1)
    ones = torch.ones(gamma.shape[0], v_dim, device=gamma.device, dtype=gamma.dtype)
    query = torch.cat([root.expand(-1, nope), gamma.unsqueeze(1).expand(-1, rope)], dim=1).flatten()
    key = torch.cat([root.expand(-1, nope), ones], dim=1).flatten()
    return query, key


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
    the clip scales (the query projection, its bias, and MLA's ``wkv_b``)."""

    row: int
    module: GroupedQueryAttention | MultiHeadLatentAttention
    first_head: int  # under TP: this rank's heads are [first_head, first_head + local heads)
    query: ShardRows
    query_bias: ShardRows | None
    mla_keys: ShardRows | None  # MLA's wkv_b (compressed keys and values)

    @staticmethod
    def of(row: int, module: GroupedQueryAttention | MultiHeadLatentAttention, first_head: int) -> WatchedAttention:
        if isinstance(module, MultiHeadLatentAttention):
            query = module.wq if module.wq is not None else module.wq_b
            assert query is not None, "MLA has wq or wq_b"
            return WatchedAttention(row, module, first_head, ShardRows.of(query.weight), None,
                                    ShardRows.of(module.wkv_b.weight))
        bias = module.wq.bias
        return WatchedAttention(row, module, first_head, ShardRows.of(module.wq.weight),
                                ShardRows.of(bias) if bias is not None else None, None)

    def clip(self, gamma: torch.Tensor) -> None:
        """Scale this module's weights by the whole model's per-head factors ``gamma`` [heads]."""
        m = self.module
        if isinstance(m, MultiHeadLatentAttention):
            query_scale, key_scale = mla_row_scales(gamma, m.nope, m.rope, m.v_dim)
            assert self.mla_keys is not None
            self.mla_keys.scale(key_scale)
        else:
            query_scale = gqa_row_scales(gamma, m.head_dim)
        self.query.scale(query_scale)
        if self.query_bias is not None:  # a biased query scales with its rows
            self.query_bias.scale(query_scale)


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
                if not isinstance(module, (GroupedQueryAttention, MultiHeadLatentAttention)):
                    continue
                _check_supported(name, module)
                watch(module, heads // tp_size, module.wo.weight.device)
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
        device = next(iter(self.watched)).module.wo.weight.device if self.watched else torch.device("cpu")
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
    if isinstance(module, MultiHeadLatentAttention):
        return module.wkv_b.weight.shape[0] // (module.nope + module.v_dim)
    assert isinstance(module, GroupedQueryAttention)
    return module.wq.weight.shape[0] // module.head_dim


def _check_supported(name: str, module: nn.Module) -> None:
    if isinstance(module, GroupedQueryAttention) and module.q_norm is not None:
        raise ValueError(f"optimizer.name=MuonClip: {name} normalizes its queries and keys per head (QK-norm), so "
                         "scaling wq cannot reach the logit; use --optimizer.name Muon")
