"""Which pipeline ranks a dry run must simulate, and which ones each of them stands for.

The pipeline ranks of a job run the same code on different stages. Two pp ranks whose stages have
the same shape (per local stage: whether it holds the embedding, how many layers, whether it holds
the output) run the same ops, on the same local shapes, in every micro-batch, and send and receive
the same tensors: their work and traffic are equal. What differs between them is where they sit in
the schedule: a rank earlier in the pipeline starts more micro-batches before its first backward,
so it holds at least as many in flight. In the schedules listed in ``IN_FLIGHT_FALLS`` that count
never grows down the pipeline, so the lowest pp rank of each shape has the highest memory peak of
its shape, and it stands for the others. The first and the last pp ranks always have a shape of
their own (the embedding, the output).

Even split points give three shapes: first, middle, last. Uneven ones (a stage with one layer more
or less) give more, and each is simulated. In other schedules (the zero-bubble ones, whose
warm-up is shaped differently) every pp rank is simulated. tests/planning/test_symmetry.py checks
the counted totals against a simulation of every rank.
"""

from __future__ import annotations

import dataclasses
from typing import cast

import torch

from torchtitan.config import JobConfig
from torchtitan.distributed.pipeline_plan import PipelinePlan
from torchtitan.planning.compute import PhaseWork
from torchtitan.planning.memory import MemoryReport, fold
from torchtitan.planning.traffic import CollectiveStats, TrafficLedger
from torchtitan.preflight import LaunchPlan

# Schedules whose micro-batches in flight do not grow with the pp rank: GPipe and LoopedBFS run every
# forward first on every rank; 1F1B's and Interleaved1F1B's warm-up shrinks down the pipeline.
IN_FLIGHT_FALLS = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS")

StageShape = tuple[tuple[bool, int, bool], ...]


def stage_shape(plan: PipelinePlan, pp_rank: int) -> StageShape:
    """Per local stage of ``pp_rank``: (holds the embedding, its layers, holds the output)."""
    starts, last = plan.layer_starts, plan.num_stages - 1
    return tuple((s == 0, starts[s + 1] - starts[s], s == last) for s in plan.stage_ids(pp_rank))


def representatives(plan: PipelinePlan | None) -> dict[int, list[int]]:
    """pp rank to simulate -> the pp ranks it stands for (itself first); every pp rank when the schedule
    is not one of ``IN_FLIGHT_FALLS``, {0: [0]} without a pipeline."""
    if plan is None:
        return {0: [0]}
    if plan.schedule not in IN_FLIGHT_FALLS:
        return {r: [r] for r in range(plan.pp)}
    groups: dict[StageShape, list[int]] = {}
    for r in range(plan.pp):
        groups.setdefault(stage_shape(plan, r), []).append(r)
    return {ranks[0]: ranks for ranks in groups.values()}


def describe(plan: PipelinePlan | None) -> str | None:
    """One line for the report: which pp ranks were simulated and what each stands for (None without PP)."""
    if plan is None:
        return None
    reps = representatives(plan)
    if plan.schedule not in IN_FLIGHT_FALLS:
        return (f"every pipeline rank simulated: {plan.schedule}'s micro-batches in flight are not known to "
                "fall down the pipeline, so no rank stands for another")
    parts = []
    for rep, ranks in reps.items():
        layers = "+".join(str(n) for _, n, _ in stage_shape(plan, rep))
        others = _ranges(ranks[1:])
        parts.append(f"{rep} ({layers} layers" + (f"; stands for {others})" if others else ")"))
    uneven = len(reps) > 3  # more than first, middle and last
    note = ("; the split is uneven (stages of different sizes), so each distinct stage shape is simulated"
            if uneven else "")
    return (f"pipeline ranks simulated: {', '.join(parts)}; ranks of one stage shape do the same work and "
            f"traffic, and the lowest holds the most micro-batches in flight{note}")


def _ranges(ranks: list[int]) -> str:
    """'1-6, 9' from [1, 2, 3, 4, 5, 6, 9]."""
    out: list[str] = []
    for r in ranks:
        if out and out[-1].split("-")[-1] == str(r - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ", ".join(out)


# ---- identical layers -------------------------------------------------------------------------------
# A job without a pipeline whose blocks are all alike is simulated twice, with 3 and with 4 blocks (a first,
# one or two middle, a last), and its totals are carried to its own block count along the line through the
# two. Work, collectives and the state after the step are sums over the blocks: each middle block adds the
# same. The peak is a maximum, not a sum, so it is carried region by region (``MemoryLedger.enter``: each
# block's forward and backward begins one): within the forward or backward of the k-th middle block the
# memory is what it was when the middle blocks began, plus k times what one middle block leaves behind,
# plus that block's own profile. So the highest total of every region lies on a line in the number of
# middle blocks, and the peak is the highest of those lines at the job's count.
SIMULATED_BLOCKS = (3, 4)
FEWEST_BLOCKS = 8  # below this, two simulations of 3 and 4 blocks cost about as much as one of all of them


def blocks_to_count(plan: LaunchPlan, cfg: JobConfig) -> tuple[int | None, str]:
    """The job's block count when it is simulated with ``SIMULATED_BLOCKS`` and counted, else None; and why."""
    n = plan.model_args.n_layers
    ac = cfg.activation_checkpoint
    if plan.pipeline is not None:
        return None, ""  # the pipeline ranks are reduced instead (``representatives``)
    if n < FEWEST_BLOCKS:
        return None, ""
    if ac.mode == "selective" and ac.selective_ac_option not in ("op", "1"):
        return None, (f"every block simulated: selective AC every {ac.selective_ac_option} blocks makes the blocks "
                      "differ")
    if not _blocks_alike(plan):
        return None, "every block simulated: the model's blocks differ in their modules or parameter shapes"
    return n, (f"blocks counted: 3 and 4 of the {n} simulated, the middle ones counted {n - 2} times "
               "(each middle block does the same work, traffic and memory)")


def _blocks_alike(plan: LaunchPlan) -> bool:
    with torch.device("meta"):
        model = plan.model_spec.build(plan.model_args)
    signatures = {(tuple(type(m).__name__ for m in block.modules()),
                   tuple((name, tuple(p.shape), p.dtype) for name, p in block.named_parameters()))
                  for block in cast(torch.nn.ModuleDict, model.layers).values()}
    return len(signatures) == 1


def with_blocks(plan: LaunchPlan, blocks: int) -> LaunchPlan:
    """``plan`` for the same model with ``blocks`` blocks."""
    return dataclasses.replace(plan, model_args=dataclasses.replace(plan.model_args, n_layers=blocks))


def _line(a: int, b: int, extra: int) -> int:
    """The value at ``SIMULATED_BLOCKS[0] + extra`` blocks of the line through ``a`` (3 blocks) and ``b`` (4)."""
    return a + extra * (b - a)


def _lines(a: dict[str, int], b: dict[str, int], extra: int) -> dict[str, int]:
    return {k: _line(a.get(k, 0), b.get(k, 0), extra) for k in {**a, **b}}


def counted_work(a: dict[str, PhaseWork], b: dict[str, PhaseWork], extra: int) -> dict[str, PhaseWork]:
    out = {}
    for phase in {**a, **b}:
        wa, wb = dataclasses.asdict(a.get(phase, PhaseWork())), dataclasses.asdict(b.get(phase, PhaseWork()))
        out[phase] = PhaseWork(**_lines(wa, wb, extra))
    return out


def counted_traffic(a: TrafficLedger, b: TrafficLedger, extra: int) -> TrafficLedger:
    out = TrafficLedger(a.dim_of_group, group_ranks=a.group_ranks)
    for key in {**a.stats, **b.stats}:
        sa, sb = a.stats.get(key, CollectiveStats()), b.stats.get(key, CollectiveStats())
        out.stats[key] = CollectiveStats(_line(sa.count, sb.count, extra), _line(sa.bytes, sb.bytes, extra))
    return out


def counted_memory(a: MemoryReport, b: MemoryReport, extra: int) -> MemoryReport:
    """The peak at ``3 + extra`` blocks: the highest of the regions' lines (see above)."""
    ra, rb = _merged(a.regions), _merged(b.regions)
    if [r[0] for r in ra] != [r[0] for r in rb]:
        raise RuntimeError("symmetry: the simulations with 3 and 4 blocks passed different regions; simulate every "
                           "block (a bug: the blocks are not alike)")
    best: tuple[int, dict[str, int], str] | None = None
    for (_, ta, sa, phase), (_, tb, sb, _) in zip(ra, rb, strict=True):
        total = _line(ta, tb, extra)
        if best is None or total > best[0]:
            best = (total, _lines(sa, sb, extra), phase)
    assert best is not None, "a simulation enters its first region before it allocates"
    return MemoryReport(peak_bytes=best[0], at_peak=fold(best[1]), final=_lines(a.final, b.final, extra),
                        peak_phase=best[2])


def _merged(regions: list[list]) -> list[list]:
    """One region for each run of middle blocks (its highest total), as the other regions are."""
    out: list[list] = []
    for r in regions:
        if out and r[0] == out[-1][0] and r[0].endswith("middle"):
            out[-1] = max(out[-1], r, key=lambda x: x[1])
        else:
            out.append(r)
    return out
