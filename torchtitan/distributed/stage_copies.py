"""Parameters that the first and the last pipeline stage both hold: Megatron's shared embedding.

DeepSeek-V3's multi-token prediction modules sit on the last stage and read the embedding, which the
first stage holds for the input (``DeepSeekV3Model.prune_stage`` keeps it on both). Such a parameter is
still one parameter of the model (one FQN, one init spec, one checkpoint entry) held twice, and the two
copies stay equal:

- at the start, the layout-invariant init draws both from the same (seed, name, shape); ``sync_values``
  copies the first stage's into the last's anyway (an unseeded run draws each stage from its own state),
  and a checkpoint loads the one entry into both;
- after each step's backward, ``sum_grads`` sums their gradients over the two holders, so each copy holds
  the whole model's gradient and the optimizer (the same state, the same update) moves both alike;
- the global gradient norm counts the parameter once: the last stage's copy is ``uncounted``.

Which FQNs are shared is read off the family's own pruning (``shared_fqns``): nothing is declared twice.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtitan.compat import dtensor_local
from torchtitan.distributed.parallel_dims import WORLD_AXES, ParallelDims
from torchtitan.distributed.pipeline_parallel import PruneStage, prune_to_stage
from torchtitan.distributed.pipeline_plan import PipelinePlan


def shared_fqns(whole: torch.nn.Module, plan: PipelinePlan, prune: PruneStage) -> set[str]:
    """The parameter FQNs that both the first and the last stage of ``plan`` keep (``whole`` on meta)."""
    first = prune_to_stage(whole, plan, 0, prune)
    last = prune_to_stage(whole, plan, plan.num_stages - 1, prune)
    return {n for n, _ in first.named_parameters()} & {n for n, _ in last.named_parameters()}


def holders_group(dims: ParallelDims, plan: PipelinePlan) -> tuple[dist.ProcessGroup | None, int]:
    """(the group of this rank's first- and last-stage ranks or None when it is neither, the first's global
    rank). A collective on every rank: the groups of every pipeline are made in one order."""
    first, last = plan.stage_owner(0), plan.stage_owner(plan.num_stages - 1)
    assert first != last, "preflight refuses a schedule that puts the first and the last stage on one rank"
    pp_mesh = dims.get_mesh("pp")
    assert pp_mesh is not None, "a pipeline plan means PP is on"
    if pp_mesh.size() == 2:  # the pair is the whole pipeline group
        group = pp_mesh.get_group()
        return group, dist.get_global_rank(group, first)
    others = [(name, getattr(dims, name)) for name in WORLD_AXES if name != "pp"]
    me, mine, src = dist.get_rank(), None, -1
    for coords in itertools.product(*(range(size) for _, size in others)):
        at = dict(zip((name for name, _ in others), coords))
        ranks = [dims.rank_at(pp=first, **at), dims.rank_at(pp=last, **at)]
        group = dist.new_group(ranks)
        if me in ranks:
            assert isinstance(group, dist.ProcessGroup), "new_group gives each of its ranks the group"
            mine, src = group, ranks[0]
    return mine, src


class StageCopies:
    """This rank's copies of the shared parameters (none on a middle stage), and the two holders' group."""

    def __init__(self, params: list[torch.nn.Parameter], group: dist.ProcessGroup | None, src: int):
        self.params, self.group, self.src = params, group, src

    @classmethod
    def of(cls, whole: torch.nn.Module, plan: PipelinePlan, prune: PruneStage, dims: ParallelDims,
           parts: list[torch.nn.Module]) -> StageCopies | None:
        """The copies of the model whose meta original is ``whole`` in this rank's ``parts``; None when the
        first and the last stage share nothing (every family but DeepSeek-V3 with MTP)."""
        fqns = shared_fqns(whole, plan, prune)
        if not fqns:
            return None
        group, src = holders_group(dims, plan)
        params = [p for part in parts for name, p in part.named_parameters() if name in fqns]
        return cls(params if group is not None else [], group, src)

    @property
    def holds_first(self) -> bool:
        return dist.get_rank() == self.src

    @torch.no_grad()
    def sync_values(self) -> None:
        """The last stage's copies take the first stage's values (after init)."""
        for p in self.params:
            dist.broadcast(_local(p), src=self.src, group=self.group)

    @torch.no_grad()
    def sum_grads(self) -> None:
        """Each copy's gradient becomes the sum of both (after the step's backward, before clipping)."""
        for p in self.params:
            if p.grad is None:  # a copy that no loss reached this step still joins the sum
                p.grad = torch.zeros_like(p)
            dist.all_reduce(_local(p.grad), group=self.group)

    def uncounted(self) -> list[torch.nn.Parameter]:
        """The copies the global gradient norm leaves out: the last stage's, the first stage's counting."""
        return [] if self.holds_first else self.params


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor a collective works on in place: a DTensor's local shard (both holders shard alike)."""
    return dtensor_local(t) if isinstance(t, DTensor) else t
