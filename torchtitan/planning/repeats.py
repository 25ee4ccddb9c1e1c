"""What a dry run counts instead of simulating: identical blocks, and identical micro-batches.

A rank's step repeats itself in two ways. The blocks of a stage (of the model, without a pipeline) are
alike, and so are the micro-batches of a step. Both are counted the same way: the rank is simulated
at two small sizes, and every total is carried to the job's size along the line through the two.

**Blocks.** Each stage is simulated with ``fewer`` blocks less than it holds (3 in the smallest stage:
a first, one middle, a last) and with one more. Where the blocks alternate (GPT-OSS: a windowed layer, then a
full one, whose attention does more work), they repeat in runs of ``period`` blocks and count as runs: 4 and 6
blocks are simulated for a period of 2, the last of the job's last block's kind. Work, collectives and the state
after the step are sums over the blocks: each middle block (run) adds the same. The peak is a maximum, not a
sum, so it is carried region by region (``MemoryLedger.enter``: each block's forward and backward begins one):
within the forward or backward of the k-th middle block of a stage, the memory is what it was when
that stage's middle blocks began, plus k times what one middle block leaves behind, plus that
block's own profile; and what a stage's earlier micro-batches keep in flight grows by one block's
share per block. So the highest total of every region lies on a line in the number of middle blocks,
and the peak is the highest of those lines at the job's count.

**Micro-batches.** Past a first count, one more micro-batch (one more round of ``pp`` of them under
Interleaved1F1B) inserts the same stretch of ops into the step: a forward in the forward phase and a
backward in the backward phase (GPipe, gradient accumulation), or one more turn of the
steady phase (1F1B, Interleaved1F1B), whose forward and backward leave the memory as they found it.
So work and collectives grow by the same amount per stretch, and so does the peak: by one
micro-batch's activations where every forward runs before the first backward, by nothing where the
warm-up sets how many are in flight. ``MICROBATCH_START`` gives, per schedule, the first count from
which that holds and the size of a stretch; the two simulations are that count and one stretch more.
Gradient accumulation over a pipeline counts whole schedules instead: each micro-step past the first
runs the same schedule and adds to the same gradients (Kimi K2 accumulates 16 flushes; DeepSeek-V3 671B runs one).

tests/planning/test_repeats.py checks each against the simulation of the whole step.
"""

from __future__ import annotations

import dataclasses

import torch

from torchtitan.config.job_config import ActivationCheckpoint, Parallelism, Training
from torchtitan.distributed.activation_checkpoint import is_per_op
from torchtitan.launch_plan import LaunchPlan
from torchtitan.optim.muon import MUON_OPTIMIZERS
from torchtitan.planning.compute import PhaseWork
from torchtitan.planning.memory import MemoryReport, fold
from torchtitan.planning.traffic import CollectiveStats, TrafficLedger

FEWEST_BLOCKS = 8  # below this, two simulations of 3 and 4 blocks cost about as much as one of all of them


@dataclasses.dataclass(frozen=True)
class Variant:
    """One simulation's size: the plan, and the two sections a size changes (the local batch and the pipeline's
    micro-batches); the dry run runs the job with these in place of its own."""

    training: Training
    parallelism: Parallelism
    plan: LaunchPlan


@dataclasses.dataclass(frozen=True)
class Repeats:
    """How one job's ranks are simulated smaller and counted back; the defaults simulate everything."""

    fewer_blocks: int = 0  # blocks per stage left out of the first simulation (the second has one period more)
    block_period: int = 1  # the blocks repeat in runs of this many (the second simulation's extra blocks)
    microbatches: tuple[int, int] | None = None  # the two micro-batch counts simulated, None: the job's own
    job_microbatches: int = 1  # the job's micro-batches per step (pipeline, else gradient accumulation)
    notes: tuple[str, ...] = ()

    @property
    def counts_blocks(self) -> bool:
        return self.fewer_blocks > 0

    @property
    def block_runs(self) -> int:
        """Runs of ``block_period`` blocks between the first simulation and the job."""
        return self.fewer_blocks // self.block_period

    def variants(self, job: Variant) -> list[Variant]:
        """The sizes to simulate ``job`` at: for each micro-batch count, each block count (blocks vary fastest);
        ``count_back`` in dry_run.py takes their runs in this order."""
        sizes = [None] if self.microbatches is None else list(self.microbatches)
        fewer = [self.fewer_blocks, self.fewer_blocks - self.block_period] if self.counts_blocks else [0]
        out = []
        for m in sizes:
            v = job if m is None else with_microbatches(job, m)
            out += [dataclasses.replace(v, plan=with_fewer_blocks(v.plan, k)) for k in fewer]
        return out

    @property
    def microbatch_stretches(self) -> int:
        """Stretches of micro-batches between the first simulated count and the job's."""
        if self.microbatches is None:
            return 0
        first, second = self.microbatches
        return (self.job_microbatches - first) // (second - first)


# ---- identical blocks ------------------------------------------------------------------------------------------
def stage_blocks(plan: LaunchPlan) -> list[int]:
    """Blocks per pipeline stage (the whole model without a pipeline)."""
    if plan.pipeline is None:
        return [plan.model_args.n_layers]
    starts = plan.pipeline.layer_starts
    return [starts[s + 1] - starts[s] for s in range(len(starts) - 1)]


def blocks_to_count(plan: LaunchPlan, ac: ActivationCheckpoint, optimizer: str = "AdamW") -> tuple[int, str]:
    """Blocks per stage left out of the first simulation (0: every block simulated), and why."""
    fewer, _, why = block_counting(plan, ac, optimizer)
    return fewer, why


def block_counting(plan: LaunchPlan, ac: ActivationCheckpoint, optimizer: str = "AdamW") -> tuple[int, int, str]:
    """(blocks per stage left out of the first simulation, 0: every block simulated; the blocks' period, which the
    second simulation adds; why)."""
    counts = stage_blocks(plan)
    fewest = min(counts)
    if fewest < FEWEST_BLOCKS:
        return 0, 1, ""
    if optimizer in MUON_OPTIMIZERS:
        return 0, 1, ("every block simulated: Muon balances its owners over all the job's matrices, so a rank's "
                      "share of the Newton-Schulz work does not grow by the same amount with each block")
    if ac.mode == "selective" and not (is_per_op(ac.selective_ac_option) or ac.selective_ac_option == "1"):
        return 0, 1, (f"every block simulated: selective AC every {ac.selective_ac_option} blocks makes the blocks "
                      "differ")
    period = _block_period(plan)
    if period is None:
        return 0, 1, ("every block simulated: the model's blocks differ in their modules, parameter shapes or "
                      "attention windows, in no short repeating pattern")
    # A first block, at least one run of middle ones, and a last of the job's last block's kind.
    first = period + 2 + (fewest - period - 2) % period
    fewer = fewest - first
    each = ("each middle block does the same work, traffic and memory" if period == 1 else
            f"the blocks repeat every {period}, and each run of {period} middle blocks does the same work, traffic "
            "and memory")
    if plan.pipeline is None:
        counted = (f"the middle ones counted {fewest - 2} times" if period == 1 else
                   f"the other {fewer} counted in runs of {period}")
        return fewer, period, (f"blocks counted: {first} and {first + period} of the {fewest} simulated, {counted} "
                               f"({each})")
    more = "one more" if period == 1 else f"{period} more"
    return fewer, period, (f"blocks counted: each stage simulated with {fewer} blocks fewer than it holds and with "
                           f"{more} ({first} and {first + period} in a stage of {fewest}), its middle blocks counted "
                           f"({each})")


_LONGEST_PERIOD = 4  # GPT-OSS alternates two kinds of block; past a few, counting would save little


def _block_period(plan: LaunchPlan) -> int | None:
    """The fewest blocks after which the model's blocks repeat (1: every block alike); None: none up to
    ``_LONGEST_PERIOD`` (DeepSeek-V3's dense first blocks, say)."""
    with torch.device("meta"):
        model = plan.model_spec.build(plan.model_args)
    # A sliding window's block does less attention work than a full one's (GPT-OSS's alternate layers, priced
    # over the pairs each window keeps: sink_attention.py), so the window is part of a block's signature.
    signatures = [(tuple((type(m).__name__, getattr(m, "window", None)) for m in block.modules()),
                   tuple((name, tuple(p.shape), p.dtype) for name, p in block.named_parameters()))
                  for block in model.get_submodule("layers").children()]
    for period in range(1, _LONGEST_PERIOD + 1):
        if all(signatures[i] == signatures[i - period] for i in range(period, len(signatures))):
            return period
    return None


def with_fewer_blocks(plan: LaunchPlan, fewer: int) -> LaunchPlan:
    """``plan`` for the same model with ``fewer`` blocks less in each stage."""
    if fewer == 0:
        return plan
    counts = [n - fewer for n in stage_blocks(plan)]
    args = plan.model_args.with_first_layers(sum(counts))  # a per-layer pattern (GPT-OSS's windows) cut alike
    if plan.pipeline is None:
        return dataclasses.replace(plan, model_args=args)
    starts = [0]
    for n in counts:
        starts.append(starts[-1] + n)
    return dataclasses.replace(plan, model_args=args,
                               pipeline=dataclasses.replace(plan.pipeline, layer_starts=tuple(starts)))


# ---- identical micro-batches -----------------------------------------------------------------------------------
def microbatch_start(plan: LaunchPlan) -> tuple[int, int] | None:
    """(the first count of micro-batches from which one more stretch adds the same ops, a stretch's size) for the
    job's schedule; None where that is not known (the zero-bubble schedules: every micro-batch simulated)."""
    p = plan.pipeline
    if p is None:
        return 2, 1  # gradient accumulation: the first micro-batch creates the gradients, the others add to them
    if p.schedule == "GPipe":
        # Every forward before the first backward. With two, the peak can lie in the backward of the first one
        # instead, off the line that the micro-batches in flight draw from three on.
        return max(3, p.pp), 1
    if p.schedule == "1F1B":
        return p.pp + 1, 1  # the lowest rank's warm-up is pp forwards; past it, a steady turn exists on every rank
    if p.schedule == "Interleaved1F1B":
        # Rounds of pp micro-batches. The warm-up ((v - 1) pp + 2 (pp - 1 - rank) ops) is shorter than the step
        # on every rank from two rounds on, but the peak still moves between the second round and the third
        # (tests/planning/test_repeats.py shows the line from the third on).
        return 3 * p.pp, p.pp
    # LoopedBFS (each local stage runs every micro-batch in turn) draws no line from a first count that holds for
    # every rank and pipeline degree measured here, and the zero-bubble schedules were not measured: every
    # micro-batch is simulated.
    return None


def microbatches_to_count(plan: LaunchPlan) -> tuple[tuple[int, int] | None, int, str]:
    """(the two micro-batch counts to simulate, None: the job's own; the job's count; why)."""
    p = plan.pipeline
    if p is not None and plan.grad_accum > 1:
        return _accumulated_schedules(plan.grad_accum)
    job = plan.grad_accum if p is None else p.microbatches
    start = microbatch_start(plan)
    if start is None:
        assert p is not None, "gradient accumulation always has a start"
        return None, job, (f"every micro-batch simulated: {p.schedule}'s step was not measured to repeat from a "
                           "first count of micro-batches" if job > 2 * p.pp else "")
    first, stretch = start
    second = first + stretch
    if job < first + second:
        return None, job, ""
    if (job - first) % stretch:
        return None, job, (f"every micro-batch simulated: {job} micro-batches are not {first} plus whole rounds of "
                           f"{stretch}")
    what = "accumulated micro-batches" if p is None else "pipeline micro-batches"
    return (first, second), job, (f"{what} counted: {first} and {second} of the {job} simulated, the others counted "
                                  "(past the first, each adds the same ops and the same memory; the split of the "
                                  "kept activations between the largest micro-batch and the others is approximate, "
                                  "their sum exact)")


def _accumulated_schedules(job: int) -> tuple[tuple[int, int] | None, int, str]:
    """Gradient accumulation over a pipeline: each micro-step runs the whole schedule (its own micro-batches) and
    adds to the gradients the first one created, so the steps past the first are alike, as without a pipeline; the
    schedule's micro-batches are simulated as the job has them."""
    if job < 2 + 3:
        return None, job, ""
    return (2, 3), job, (f"accumulated pipeline schedules counted: 2 and 3 of the {job} simulated, the others counted "
                         "(past the first, each runs the same schedule and adds to the same gradients)")


def with_microbatches(job: Variant, m: int) -> Variant:
    """``job`` with ``m`` micro-batches of the same size a step: accumulated micro-steps (each a whole pipeline
    schedule under a pipeline) where the job accumulates, else the pipeline's micro-batches."""
    plan, p = job.plan, job.plan.pipeline
    if p is None or plan.grad_accum > 1:
        return dataclasses.replace(job, plan=dataclasses.replace(plan, grad_accum=m))
    t = job.training
    return Variant(training=dataclasses.replace(t, batch_size=t.batch_size // p.microbatches * m),
                   parallelism=dataclasses.replace(job.parallelism, pipeline_parallel_microbatches=m),
                   plan=dataclasses.replace(plan, pipeline=dataclasses.replace(p, microbatches=m)))


def plan_repeats(plan: LaunchPlan, ac: ActivationCheckpoint, optimizer: str = "AdamW") -> Repeats:
    """What ``plan``'s ranks count rather than simulate (``ac``: the job's activation checkpointing; ``optimizer``:
    its ``--optimizer.name``)."""
    fewer, period, why_blocks = block_counting(plan, ac, optimizer)
    sizes, job, why_microbatches = microbatches_to_count(plan)
    return Repeats(fewer, period, sizes, job, tuple(line for line in (why_blocks, why_microbatches) if line))


# ---- counting back -----------------------------------------------------------------------------------------------
def _line(a: int, b: int, extra: int) -> int:
    """The value ``extra`` steps past ``a`` on the line through ``a`` and ``b`` (one step apart)."""
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
    # each middle block's all-to-alls, and the work that hides them, alike
    out.covers.update({k: _line(a.covers.get(k, 0), b.covers.get(k, 0), extra) for k in {**a.covers, **b.covers}})
    return out


def counted_memory(a: MemoryReport, b: MemoryReport, extra: int) -> MemoryReport:
    """Blocks: the peak ``extra`` middle blocks past ``a``'s, the highest of the regions' lines (see above)."""
    ra, rb = _merged(a.regions), _merged(b.regions)
    if [r[0] for r in ra] != [r[0] for r in rb]:
        raise RuntimeError("repeats: the two simulations passed different regions; simulate every block (a bug: "
                           "the blocks are not alike)")
    best: tuple[int, dict[str, int], str] | None = None
    for (_, ta, sa, phase), (_, tb, sb, _) in zip(ra, rb, strict=True):
        total = _line(ta, tb, extra)
        if best is None or total > best[0]:
            best = (total, _lines(sa, sb, extra), phase)
    assert best is not None, "a simulation enters its first region before it allocates"
    return MemoryReport(peak_bytes=best[0], at_peak=fold(best[1]), final=_lines(a.final, b.final, extra),
                        peak_phase=best[2])


def counted_peak(a: MemoryReport, b: MemoryReport, extra: int) -> MemoryReport:
    """Micro-batches: the peak, its split and the state after the step ``extra`` stretches past ``a``'s (each
    stretch raises the peak by the same amount, often none: see above)."""
    if a.peak_phase != b.peak_phase:
        raise RuntimeError(f"repeats: the peak moved from {a.peak_phase} to {b.peak_phase} with one more stretch of "
                           "micro-batches; simulate every micro-batch (--no_symmetry)")
    return MemoryReport(peak_bytes=_line(a.peak_bytes, b.peak_bytes, extra),
                        at_peak=_lines(a.at_peak, b.at_peak, extra), final=_lines(a.final, b.final, extra),
                        peak_phase=b.peak_phase)


def _merged(regions: list[list]) -> list[list]:
    """One region for each run of middle blocks (its highest total), as the other regions are."""
    out: list[list] = []
    for r in regions:
        if out and r[0] == out[-1][0] and r[0].endswith("middle"):
            out[-1] = max(out[-1], r, key=lambda x: x[1])
        else:
            out.append(r)
    return out
