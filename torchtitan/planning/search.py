"""``--search``: the valid layouts for a world size, each dry-run and costed, best first.

Enumerated: tensor parallel degrees up to a node (1, 2, 4, 8), pipeline degrees (1, 2, 4, 8, 16)
with 1F1B and Interleaved1F1B (one micro-batch per sequence of the local batch), context parallel
degrees for long sequences (seq_len >= 32k), expert parallel degrees (1 to 64) for a model with
experts, full and selective activation checkpointing (and for a model with experts the per-op 'moe' policy,
which keeps the all-to-alls and GEMMs and recomputes norms, activations, the router and MLA's
up-projections), and the local batch that keeps the config's
global batch, and with ``float8`` (a cluster with FP8 tensor cores) each of them again in Float8
(tensorwise, FP8 all-gather, scales after the step). The preflight drops what it refuses; layouts that
do not fit the cluster's memory are dropped; the rest are ranked by predicted tokens/s per GPU.
Each pipelined layout is simulated on its first and last pipeline ranks only, and every simulated
rank of every layout shares one pool of worker processes (one per core).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from torchtitan.config import ConfigError, ConfigManager
from torchtitan.config.job_config import Model, Parallelism, Training
from torchtitan.planning.clusters import Cluster
from torchtitan.planning.cost import StepEstimate, estimate
from torchtitan.planning.dry_run import dry_runs, plan_job
from torchtitan.planning.progress import Progress

TP_DEGREES = (1, 2, 4, 8)
PP_DEGREES = (1, 2, 4, 8, 16)
CP_DEGREES = (1, 2, 4, 8)
EP_DEGREES = (1, 2, 4, 8, 16, 32, 64)
LONG_SEQUENCE = 32768
# The Float8 variant a search proposes: TorchTitan's fastest recipe with FSDP (docs/float8.md).
FLOAT8 = ["--model.converters=float8", "--float8.recipe_name=tensorwise", "--float8.enable_fsdp_float8_all_gather",
          "--float8.precompute_float8_dynamic_scale_for_fsdp"]


@dataclass(frozen=True)
class SearchBasis:
    """What the search keeps of the job it lays out: its global batch (sequences), sequence length and routed
    experts (0 for a dense model or one the registry does not know)."""

    global_batch: int
    seq_len: int
    experts: int

    @classmethod
    def of(cls, model: Model, training: Training, parallelism: Parallelism, world_size: int) -> SearchBasis:
        """The job's basis: its global batch is the local batch times the config's data-parallel degree."""
        return cls(training.batch_size * _config_dp(parallelism, world_size), training.seq_len, _num_experts(model))


@dataclass
class Layout:
    overrides: list[str]
    estimate: StepEstimate

    def to_json(self) -> dict:
        return {**self.estimate.to_json(), "overrides": self.overrides}


_AC = "--activation_checkpoint."


def _ac_choices(experts: int) -> list[list[str]]:
    """Full and selective AC (the config's option); with experts also the per-op 'moe' and 'exchange' policies,
    whose memory and recompute the dry run measures from the ops they keep, so the ranking prices them like the
    others ('exchange' only under EP: without it, it is full AC)."""
    per_op = [[f"{_AC}mode=selective", f"{_AC}selective_ac_option={p}"] for p in ("moe", "exchange")] if experts else []
    return [[f"{_AC}mode=full"], [f"{_AC}mode=selective"], *per_op]


def _ep_fits(ep: int, data: int, tp: int) -> bool:
    """ParallelDims' rule: ep divides dp_shard x cp, or is a multiple of tp dividing dp_shard x cp x tp."""
    return data % ep == 0 or (ep % tp == 0 and (data * tp) % ep == 0)


def candidate_overrides(job: SearchBasis, world_size: int, gpus_per_node: int) -> list[list[str]]:
    """Every layout to try, as train.py overrides (not yet checked by the preflight)."""
    global_batch, experts = job.global_batch, job.experts
    out = []
    cps = CP_DEGREES if job.seq_len >= LONG_SEQUENCE else (1,)
    for tp, pp, cp in itertools.product(TP_DEGREES, PP_DEGREES, cps):
        if tp > gpus_per_node or world_size % (tp * pp * cp):
            continue
        dp = world_size // (tp * pp * cp)
        if global_batch % dp:
            continue
        local = global_batch // dp
        schedules = [("1F1B", 1), ("Interleaved1F1B", 2)] if pp > 1 else [(None, None)]
        # EP borrows from dp_shard x cp (and all of TP where those are too few) and must divide the experts;
        # none for a dense model.
        eps = [[f"--parallelism.expert_parallel_degree={ep}"] for ep in EP_DEGREES
               if _ep_fits(ep, dp * cp, tp) and experts % ep == 0] if experts else [[]]
        for (schedule, v), ac, ep in itertools.product(schedules, _ac_choices(experts), eps):
            if f"{_AC}selective_ac_option=exchange" in ac and ep == ["--parallelism.expert_parallel_degree=1"]:
                continue  # no expert exchange to keep: full AC, already a candidate
            o = [f"--parallelism.tensor_parallel_degree={tp}", f"--parallelism.pipeline_parallel_degree={pp}",
                 f"--parallelism.context_parallel_degree={cp}", "--parallelism.data_parallel_replicate_degree=1",
                 f"--parallelism.data_parallel_shard_degree={dp}", f"--training.batch_size={local}",
                 *ac, *ep]
            if schedule is not None:
                o += [f"--parallelism.pipeline_parallel_schedule={schedule}",
                      f"--parallelism.pipeline_parallel_stages_per_rank={v}",
                      f"--parallelism.pipeline_parallel_microbatches={local}"]
            out.append(o)
    return out


def searched_overrides(job: SearchBasis, world_size: int, cluster: Cluster, float8: bool) -> list[list[str]]:
    """The candidates, and with ``float8`` on a cluster with an FP8 peak each again in Float8."""
    candidates = candidate_overrides(job, world_size, cluster.gpus_per_node)
    if float8 and cluster.peak_fp8_flops > 0:
        candidates += [[*o, *FLOAT8] for o in candidates]
    return candidates


def _num_experts(model: Model) -> int:
    """The flavor's routed experts (0 for a dense model or one the registry does not know)."""
    from torchtitan.models import model_args

    try:
        return model_args(model.name, model.flavor).num_experts
    except ValueError:
        return 0


def _config_dp(parallelism: Parallelism, world_size: int) -> int:
    from torchtitan.distributed import ParallelDims

    return ParallelDims.from_config(parallelism, world_size).degree("dp")


def search(args: list[str], world_size: int, cluster: Cluster, moe_imbalance: float = 1.0,
           float8: bool = False, progress: Progress | None = None) -> list[Layout]:
    """The layouts that the preflight accepts and that fit, best predicted tokens/s first.

    ``args`` are the job's train.py arguments; each layout's overrides are appended to them. ``float8``:
    also try each layout in Float8, where the cluster has an FP8 peak. ``progress``: lines on stderr.
    """
    cfg = ConfigManager().parse_args(args)
    accepted, jobs = [], []
    basis = SearchBasis.of(cfg.model, cfg.training, cfg.parallelism, world_size)
    candidates = searched_overrides(basis, world_size, cluster, float8)
    if progress is not None:
        progress.say(f"checking {len(candidates)} candidate layouts for {world_size} ranks with the preflight")
    for overrides in candidates:
        trial = ConfigManager().parse_args([*args, *overrides])
        try:
            plan_job(trial, world_size)
        except ConfigError:
            continue
        pp = trial.parallelism.pipeline_parallel_degree
        # The first and last pipeline ranks (embedding, output and the most in-flight micro-batches)
        # stand for the pipeline: a search prices many layouts.
        accepted.append(overrides)
        jobs.append((trial, world_size, sorted({0, pp - 1})))
    if progress is not None:
        progress.say(f"{len(jobs)} of {len(candidates)} layouts pass the preflight; simulating each")
    runs = dry_runs(jobs, moe_imbalance=moe_imbalance, progress=progress)
    layouts = [Layout(overrides, estimate(run, cluster)) for overrides, run in zip(accepted, runs, strict=True)]
    return sorted([layout for layout in layouts if layout.estimate.fits],
                  key=lambda layout: -layout.estimate.tokens_per_second_per_gpu)


def search_text(layouts: list[Layout], cluster_name: str) -> str:
    if not layouts:
        return f"No layout fits on {cluster_name}."
    lines = [f"Best layouts on {cluster_name} (predicted):"]
    for i, layout in enumerate(layouts, 1):
        e = layout.estimate
        lines.append(f"{i:2d}. {e.tokens_per_second_per_gpu:9,.0f} tok/s/GPU  MFU {100 * e.mfu:5.1f}%  "
                     f"peak {e.peak_memory_gib:6.1f} GiB  bound: {e.bound}")
        lines.append("    " + " ".join(layout.overrides))
    return "\n".join(lines)
