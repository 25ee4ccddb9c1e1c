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
the counted totals against a simulation of every rank. What each simulated rank counts rather than
simulates (its identical blocks and micro-batches) is ``repeats.py``.
"""

from __future__ import annotations

from torchtitan.distributed.pipeline_plan import PipelinePlan

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
