"""A dry run of the real trainer at any world size, in one CPU process, on fake tensors.

``dry_run(cfg, world_size)`` checks the job with the trainer's preflight, then, for each rank that
differs (one pipeline rank per stage shape, ``symmetry.py``; within one, rank 0 of every other dim
holds the largest shard of every uneven split, which FSDP pads the others to), joins a fake process
group of ``world_size`` ranks as that rank and builds what the trainer builds, with the trainer's own
``build_runner``: the ``ParallelDims`` mesh, the model parallelized by ``distributed/parallelize.py``
(TP/SP/loss parallel, CP, AC, FSDP/HSDP and mixed precision), the pipeline stages and schedule, the
optimizer and the LR schedule.
It then runs the trainer's own step (``PlainStep``: loss scale, forward and backward over every
micro-batch or the pipeline schedule, gradient clipping, the optimizer and LR steps, the loss sums)
under ``FakeTensorMode``: shapes, dtypes and every op and collective, but no data and no memory of
the model's size. A recorder (``StepRecorder``), told what the step is doing through the step's
callbacks, counts each storage at its local size (``memory.py``), each collective by mesh dim
(``traffic.py``) and each op's work (``compute.py``). A rank's
identical blocks and micro-batches are simulated at two small counts and counted at the job's (``repeats.py``).

What differs from a GPU run, and how it is handled:

- the step runs the CPU code path with the GPU's dtype policy: ``build_runner`` is told the device
  type is CUDA (bf16 compute over fp32 master weights when ``mixed_precision_param`` is auto), so
  the eager-CPU kernels of ``ops/cpu_kernels.py`` are not swapped in and the model runs the code
  that GPUs run; the loss is one cross-entropy, as on a GPU;
- attention is causal over each whole window (no positions are passed): under ``block_causal`` a
  GPU runs FlexAttention, whose work on packed documents is at most the causal figure; attention
  with a value head of its own size (MLA) runs as the fused kernel a GPU has for it
  (``fused_attention.py``), not the CPU's decomposition, and GPT-OSS's sink attention as FlexAttention
  with its windows' block masks (``sink_attention.py``), not the CPU's dense kernel;
- no weights are initialized (they are fake; init reads random values: ``init_weights=False``), the
  tokenizer and the data set are not read (the flavor's vocabulary and random token ids stand in),
  and the checkpoint manager is not built (it opens a gloo group and installs signal handlers);
- the loss and grad norm are never read on the host;
- a MoE layer's token counts are assumed (balanced, or an imbalance factor; ``planning/moe.py``): fake
  tensors hold no counts to size its all-to-all with.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import os
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

import torch
import torch.distributed as dist

from torchtitan.batch import Batch
from torchtitan.compat import (
    REDISTRIBUTE_LOGGER,
    FakeTensorMode,
    fake_process_group_store,
    grouped_mm_as_on,
    member_groups_only,
)
from torchtitan.config import JobConfig
from torchtitan.config.job_config import Model, Training
from torchtitan.datasets.tokenizer import Tokenizer
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.pipeline_plan import PipelinePlan
from torchtitan.launch_plan import LaunchPlan
from torchtitan.models import model_args
from torchtitan.planning.compute import ComputeLedger, PhaseWork
from torchtitan.planning.fused_attention import fused_attention_as_on_gpu
from torchtitan.planning.memory import MemoryLedger, MemoryReport
from torchtitan.planning.moe import GPU_GROUPED_MM_DTYPES, assume_routing, check_imbalance, moe_notes
from torchtitan.planning.muon_work import MuonOwnerWork, owner_work
from torchtitan.planning.pipeline import make_stages_static, stage_io
from torchtitan.planning.progress import Progress, simulation_label
from torchtitan.planning.recorder import StepRecorder, track_fsdp_storage
from torchtitan.planning.repeats import (
    Repeats,
    Variant,
    counted_memory,
    counted_peak,
    counted_traffic,
    counted_work,
    plan_repeats,
)
from torchtitan.planning.sink_attention import sink_attention_as_on_gpu
from torchtitan.planning.symmetry import describe as describe_symmetry
from torchtitan.planning.symmetry import representatives
from torchtitan.planning.traffic import TrafficLedger, dim_of_groups
from torchtitan.preflight import preflight
from torchtitan.train_step.base import StepParts
from torchtitan.train_step.build import BuildOptions, build_runner
from torchtitan.train_step.callbacks import StepCallbacks
from torchtitan.train_step.plain import PlainStep
from torchtitan.train_step.runner import ModelRunner

logger = logging.getLogger(__name__)


class FlavorVocabulary(Tokenizer):
    """Stands in for the tokenizer in a dry run: the flavor's vocabulary size, nothing to encode."""

    kind = "flavor"

    def __init__(self, n_words: int):
        self.model_path, self.files, self.n_words = "(the flavor's vocabulary)", [], n_words
        self.bos_id, self.eos_id = 0, 1


@dataclass
class RankRun:
    """What one simulated rank allocated, sent and computed over the recorded steps."""

    rank: int
    coords: dict[str, int]
    stages: list[int]
    memory: MemoryReport
    traffic: TrafficLedger
    work: dict[str, PhaseWork]
    seconds: float
    stands_for: list[int] = field(default_factory=list)  # the pp ranks of its stage shape (symmetry.py)
    muon: MuonOwnerWork | None = None  # Muon by owners: every owner's Newton-Schulz work (muon_work.py)

    def to_json(self) -> dict:
        return {"rank": self.rank, "coords": self.coords, "pipeline_stages": self.stages,
                "stands_for_pp_ranks": self.stands_for,
                "muon": dataclasses.asdict(self.muon) if self.muon is not None else None,
                "memory": self.memory.to_json(), "collectives": self.traffic.rows(),
                "work": {k: dataclasses.asdict(v) for k, v in self.work.items()}, "seconds": self.seconds}


@dataclass
class DryRun:
    """The job as planned, and each simulated rank's run."""

    cfg: JobConfig
    world_size: int
    plan: LaunchPlan
    steps: int  # recorded steps (after one warm-up step)
    ranks: list[RankRun] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def dims(self) -> ParallelDims:
        return self.plan.dims

    @property
    def worst(self) -> RankRun:
        return max(self.ranks, key=lambda r: r.memory.peak_bytes)

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one optimizer step in the whole job."""
        t = self.cfg.training
        return t.batch_size * t.seq_len * self.plan.grad_accum * self.dims.degree("dp")

    @property
    def flops_per_token(self) -> float:
        return self.plan.model_spec.model.flops_per_token(self.plan.model_args, self.cfg.training.seq_len)


def plan_job(cfg: JobConfig, world_size: int) -> LaunchPlan:
    """The trainer's preflight with the flavor's vocabulary and no data checks (``ConfigError`` on a bad job)."""
    vocab = model_args(cfg.model.name, cfg.model.flavor).vocab_size if _known(cfg.model) else 0
    return preflight(cfg, world_size, tokenizer=FlavorVocabulary(vocab), check_data=False)


def _known(model: Model) -> bool:
    try:
        model_args(model.name, model.flavor)
        return True
    except ValueError:
        return False


def ranks_to_simulate(dims: ParallelDims, pp_ranks: list[int] | None = None,
                      pipeline: PipelinePlan | None = None) -> list[int]:
    """Global ranks that differ: coordinate 0 on every axis but ``pp``, and the pp ranks asked for, else one
    pp rank per stage shape (``symmetry.representatives``; every pp rank without the pipeline's plan)."""
    if pp_ranks is None:
        pp_ranks = list(representatives(pipeline)) if pipeline is not None else list(range(dims.pp))
    return [dims.rank_at(pp=r) for r in pp_ranks]


def dry_run(cfg: JobConfig, world_size: int, steps: int = 1, pp_ranks: list[int] | None = None,
            workers: int | None = None, symmetry: bool = True, moe_imbalance: float = 1.0,
            progress: Progress | None = None) -> DryRun:
    """LaunchPlan ``cfg`` on ``world_size`` ranks and simulate each rank that differs: the optimizer state
    as a first step makes it, then ``steps`` recorded steps. ``moe_imbalance``: see ``planning/moe.py``;
    ``progress``: a line on stderr per simulation started and finished (``progress.py``)."""
    return dry_runs([(cfg, world_size, pp_ranks)], steps, workers, symmetry, moe_imbalance, progress)[0]


def dry_runs(jobs: list[tuple[JobConfig, int, list[int] | None]], steps: int = 1,
             workers: int | None = None, symmetry: bool = True, moe_imbalance: float = 1.0,
             progress: Progress | None = None) -> list[DryRun]:
    """``dry_run`` of several jobs (config, world size, pipeline ranks), every simulated rank of every job in
    one pool of worker processes, so that a search or a set of configs keeps every core busy.

    With ``symmetry``, one pp rank per stage shape is simulated unless ``pp_ranks`` names them
    (``symmetry.py``), and each counts its identical blocks and micro-batches (``repeats.py``); without it,
    every pp rank (or those named), every block and every micro-batch. Each job is planned first, so a bad one
    raises its ``ConfigError`` before anything is simulated (and before any progress line).
    """
    check_imbalance(moe_imbalance)
    runs, tasks, repeats = [], [], []
    for i, (cfg, world_size, pp_ranks) in enumerate(jobs):
        run = DryRun(cfg, world_size, plan_job(cfg, world_size), steps)
        training, run.notes = _simulated_training(cfg.model, cfg.training, run.plan)
        run.notes += moe_notes(run.plan, moe_imbalance)
        runs.append(run)
        counted = (plan_repeats(run.plan, cfg.activation_checkpoint, cfg.optimizer.name) if symmetry
                   else Repeats())
        repeats.append(counted)
        # Each size simulated runs the job with its own [training] and [parallelism] (repeats.py).
        sized = [(dataclasses.replace(cfg, training=v.training, parallelism=v.parallelism), v.plan)
                 for v in counted.variants(Variant(training, cfg.parallelism, run.plan))]
        by_shape = symmetry and pp_ranks is None
        tasks += [(i, [(c, plan, world_size, rank, steps, counted.counts_blocks, moe_imbalance)
                       for c, plan in sized])
                  for rank in ranks_to_simulate(run.dims, pp_ranks, run.plan.pipeline if by_shape else None)]
        run.notes += [*counted.notes, *([describe_symmetry(run.plan.pipeline) or ""] if by_shape else [])]
        run.notes = [line for line in run.notes if line]
    flat = [args for _, sims in tasks for args in sims]
    labels = [simulation_label(args[3], args[1], i, len(jobs)) for i, sims in tasks for args in sims]
    results = iter(_simulate_all(flat, labels, workers, progress))
    for i, sims in tasks:
        rank_run = count_back([next(results) for _ in sims], repeats[i])
        if symmetry and jobs[i][2] is None:  # ranks chosen by shape: each stands for the pp ranks of its shape
            rank_run.stands_for = representatives(runs[i].plan.pipeline).get(rank_run.coords.get("pp", 0), [])
        runs[i].ranks.append(rank_run)
    return runs


def _simulate_all(flat: list[tuple], labels: list[str], workers: int | None,
                  progress: Progress | None) -> list[RankRun]:
    """``simulate_rank(*args)`` of each of ``flat``, ``workers`` processes at a time; the runs in ``flat``'s order.

    One forked process per simulation: DTensor caches meshes (and their process-group names) across
    process groups, so each simulated rank needs a process of its own.
    """
    # The longest first, so that the last one to finish is a short one.
    order = sorted(range(len(flat)), key=lambda j: -_blocks_run(flat[j][1]))
    workers = max(1, min(len(flat), workers or (os.cpu_count() or 1)))
    if progress is not None:
        progress.say(f"simulating {len(flat)} rank step(s) on fake tensors, {workers} at a time; the longest first")
    numbered = [(j, f"[{n}/{len(flat)}] {labels[j]}", progress, flat[j]) for n, j in enumerate(order, 1)]
    # Each simulation in a process forked from this thread, at most ``workers`` at a time. A pool with one task
    # per child forks its replacement workers from a thread of its own; such a fork hung once in CI, its child
    # waiting on a lock that another thread of the parent (a test's server, fsspec's loop) held at the fork.
    fork = multiprocessing.get_context("fork")
    runs: dict[int, RankRun] = {}
    running: dict[Connection, BaseProcess] = {}
    while numbered or running:
        while numbered and len(running) < workers:
            reader, writer = fork.Pipe(duplex=False)
            child = fork.Process(target=_simulate_into, args=(numbered.pop(0), writer), daemon=True)
            child.start()
            writer.close()
            running[reader] = child
        ready = wait(list(running))
        for reader in [r for r in running if r in ready]:
            child = running.pop(reader)
            try:
                j, run = reader.recv()
            except EOFError:
                child.join()
                raise RuntimeError(f"dry run: a simulation process ended without a result (exit code "
                                   f"{child.exitcode})") from None
            child.join()
            if isinstance(run, BaseException):
                raise run
            runs[j] = run
            if progress is not None:
                progress.say(f"done {len(runs)} of {len(flat)}: {labels[j]} ({run.seconds:.1f} s)")
    return [runs[j] for j in range(len(flat))]


def _simulate_into(task: tuple[int, str, Progress | None, tuple], out: Connection) -> None:
    """In a forked child: one simulation, its result (or its error) sent back through ``out``."""
    try:
        result: tuple[int, RankRun | BaseException] = _simulate_numbered(task)
    except Exception as e:
        result = (task[0], e)
    out.send(result)
    out.close()


def _simulate_numbered(task: tuple[int, str, Progress | None, tuple]) -> tuple[int, RankRun]:
    """In a pool worker: say which simulation starts, run it, and hand it back with its index."""
    j, label, progress, args = task
    if progress is not None:
        progress.say(f"{label}: started")
    try:
        return j, simulate_rank(*args)
    except Exception as e:
        # The pool pickles the error back, and torch's may hold what does not pickle: the pool would then report
        # only that, and the cause would be lost. Its text and traceback travel instead.
        raise RuntimeError(f"dry run, {label}: {type(e).__name__}: {e}\n{traceback.format_exc()}") from None


def _blocks_run(plan: LaunchPlan) -> int:
    """Block forwards a simulated rank runs in a step: what its time goes as."""
    p, n = plan.pipeline, plan.model_args.n_layers
    return n * plan.grad_accum if p is None else n * p.microbatches // p.pp


def count_back(sims: list[RankRun], repeats: Repeats) -> RankRun:
    """One rank's run at the job's size from its simulations in ``Repeats.variants`` order (``repeats.py``): the
    blocks counted at each micro-batch count, then the micro-batches."""
    if repeats.counts_blocks:
        pairs = zip(sims[::2], sims[1::2], strict=True)
        sims = [_counted(a, b, repeats.block_runs, counted_memory) for a, b in pairs]
    if repeats.microbatches is not None:
        sims = [_counted(sims[0], sims[1], repeats.microbatch_stretches, counted_peak)]
    (run,) = sims
    return run


def _counted(a: RankRun, b: RankRun, extra: int, memory) -> RankRun:
    """``a`` carried ``extra`` steps along the line through ``a`` and ``b`` (``memory``: how its peak is)."""
    return RankRun(a.rank, a.coords, a.stages, memory(a.memory, b.memory, extra),
                   counted_traffic(a.traffic, b.traffic, extra), counted_work(a.work, b.work, extra),
                   a.seconds + b.seconds, muon=a.muon)  # the owners do not change with the blocks counted


def _simulated_training(model: Model, training: Training, plan: LaunchPlan) -> tuple[Training, list[str]]:
    """The [training] section to simulate the job with, and the notes on what differs from its run."""
    notes = [f"vocabulary {plan.model_args.vocab_size} from --model.flavor={model.flavor}; random "
             "token ids stand in for the data set (no tokenizer or data read)"]
    if training.compile:
        # Compiled blocks cannot run under a dispatch mode; the step is simulated eager.
        training = dataclasses.replace(training, compile=False)
        notes.append("--training.compile: simulated eager (memory and traffic as eager; compile's fusion "
                     "is not modelled)")
    return training, notes


@contextlib.contextmanager
def fake_world(rank: int, world_size: int):
    """This process as ``rank`` of a fake process group: collectives return at once and move nothing.

    Its meshes create only the groups this rank is in (``member_groups_only``): the others cost
    seconds at 16K ranks and are never used here.
    """
    if dist.is_initialized():
        raise RuntimeError("a dry run needs a process without a process group")
    dist.init_process_group("fake", store=fake_process_group_store(), rank=rank, world_size=world_size)
    try:
        with member_groups_only():
            yield
    finally:
        dist.destroy_process_group()


def simulate_rank(cfg: JobConfig, plan: LaunchPlan, world_size: int, rank: int, steps: int,
                  regions: bool = False, moe_imbalance: float = 1.0) -> RankRun:
    """One rank's step; ``regions``: the memory ledger also keeps the highest total of each block's forward and
    backward (``symmetry.counted_memory``); ``moe_imbalance``: see ``planning/moe.py``."""
    start = time.perf_counter()
    with fake_world(rank, world_size):
        dims = ParallelDims.from_config(cfg.parallelism, world_size)
        dims.build_mesh("cpu")
        memory, compute = MemoryLedger(), ComputeLedger()
        if regions:
            memory.enter("build")
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        traffic = TrafficLedger({})
        recorder = StepRecorder(memory, traffic, compute)
        # Parallelized for the GPU (its dtype policy and kernels), allocated as fake tensors, not initialized.
        io = (None if plan.pipeline is None else
              stage_io(cfg.training, cfg.parallelism, dims, plan.model_spec, plan.model_args, plan.pipeline))
        options = BuildOptions(device_type="cuda", allocate=lambda: fake, init_weights=False, describe=False,
                               stage_io=io)
        runner = build_runner(cfg, dims, plan, torch.device("cpu"), StepCallbacks([recorder.follow]), options)
        job = _Job(runner, cfg.training, plan, dims, memory, recorder, moe_imbalance)
        if regions:  # each stage's first, middle and last blocks (repeats.py)
            for part in job.runner.model_parts:
                recorder.watch_blocks(list(part.get_submodule("layers").children()))
        traffic.dim_of_group = dim_of_groups(dims)
        coords = {name: dims.rank_and_size(name)[0] for name in dims.enabled_dims}
        logging.getLogger(REDISTRIBUTE_LOGGER).setLevel(logging.ERROR)
        _prebuild_cp_masks(cfg.training.seq_len, dims)
        with (fake, recorder, track_fsdp_storage(memory), grouped_mm_as_on(GPU_GROUPED_MM_DTYPES),
              fused_attention_as_on_gpu(), sink_attention_as_on_gpu()):
            job.register_state()
            job.init_optimizer_state(recorder)
            traffic.recording = compute.recording = True
            for _ in range(steps):
                job.train_step()
        traffic.group_ranks.update(_all_group_ranks(dims, traffic))
        muon = owner_work(job.runner.optimizer, traffic.dim_of_group)
        return RankRun(rank, coords, job.stage_ids, memory.report(), traffic, dict(compute.work),
                       time.perf_counter() - start, muon=muon)


def _prebuild_cp_masks(seq_len: int, dims: ParallelDims) -> None:
    """Build CP attention's causal masks before fake mode: a mask is a tensor subclass that cannot be
    created under it (``cp_attention`` keeps them in a cache)."""
    if not dims.cp_enabled:
        return
    from torchtitan.distributed.context_parallel import _lower_right_bias

    chunk = seq_len // (2 * dims.cp)
    for g in range(2 * dims.cp):
        _lower_right_bias(chunk, (g + 1) * chunk)


def _all_group_ranks(dims: ParallelDims, traffic: TrafficLedger) -> dict[str, list[int]]:
    out = {}
    for name in dims.mesh_names():
        mesh, label = dims.get_mesh(name), dims.label(name)
        if mesh is not None and label not in traffic.group_ranks and label not in out:
            out[label] = dist.get_process_group_ranks(mesh.get_group())
    return out


class _MicrobatchTag:
    """A stage's forward pre-hook: tag what its forward allocates with (stage, micro-batch)."""

    def __init__(self, recorder: StepRecorder, stage_id: int):
        self.recorder, self.stage_id, self.calls = recorder, stage_id, 0

    def __call__(self, module, args) -> None:
        self.recorder.microbatch = f"{self.stage_id}.{self.calls}"
        self.calls += 1


class _Job:
    """The trainer's parts for one simulated rank, built by the trainer's own ``build_runner`` (``simulate_rank``)
    and stepped by its own ``PlainStep``; the recorder follows the step through the step's callbacks."""

    def __init__(self, runner: ModelRunner, training: Training, plan: LaunchPlan, dims: ParallelDims,
                 memory: MemoryLedger, recorder: StepRecorder, moe_imbalance: float = 1.0):
        self.runner, self.training, self.plan, self.dims, self.memory = runner, training, plan, dims, memory
        assume_routing(self.runner.model_parts, moe_imbalance)  # MoE layers (planning/moe.py)
        self.stage_ids: list[int] = []
        if self.runner.pp_runner is not None:
            make_stages_static(self.runner.pp_runner)
            self.stage_ids = [s.stage_index for s in self.runner.pp_runner.stages]
            for stage in self.runner.pp_runner.stages:  # tag each micro-batch's activations (memory.fold)
                stage.submod.register_forward_pre_hook(_MicrobatchTag(recorder, stage.stage_index))
        self.params = self.runner.parameters()
        self.strategy = PlainStep(StepParts(runner=self.runner, loss_mesh=dims.get_mesh("dp_cp"),
                                            pp_mesh=dims.get_mesh("pp"), max_norm=training.max_norm,
                                            dataloader=None))
        self.steps_taken = 0

    def init_optimizer_state(self, recorder: StepRecorder) -> None:
        """Create the optimizer state as a first step does (from zero gradients, without a forward)."""
        with recorder.phase("optimizer"):
            for p in self.params:
                p.grad = torch.zeros_like(p)
            self.runner.optimizer.step()
            self.runner.optimizer.zero_grad(set_to_none=True)

    def register_state(self) -> None:
        for part in self.runner.model_parts:
            for p in part.parameters():
                self.memory.register(p, "parameters")
            for b in part.buffers():
                self.memory.register(b, "buffers")

    def batches(self) -> list[Batch]:
        """A step's micro-batches of random token ids (the step cuts them to this rank's CP share)."""
        t, vocab = self.training, self.plan.model_args.vocab_size
        out = []
        for _ in range(self.plan.grad_accum):
            tokens = torch.randint(0, vocab, (t.batch_size, t.seq_len + 1))
            out.append(Batch(inputs=tokens[:, :-1], labels=tokens[:, 1:]))
        return out

    def train_step(self) -> None:
        """One optimizer step, by the trainer's own step (``PlainStep.run``): its loss scale, forward/backward
        (plain or the pipeline schedule), clipping, optimizer and LR steps; no value is read on the host."""
        self.steps_taken += 1
        self.strategy.run(self.batches(), self.steps_taken)
