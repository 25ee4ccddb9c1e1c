"""Readable tables of a dry run and of its step estimate."""

from __future__ import annotations

from torchtitan.planning.cost import StepEstimate
from torchtitan.planning.dry_run import DryRun, RankRun
from torchtitan.planning.memory import CATEGORIES, GIB


def dry_run_text(run: DryRun) -> str:
    d, t = run.dims, run.cfg.training
    lines = [f"Dry run: {run.cfg.model.name} {run.cfg.model.flavor} on {run.world_size} ranks "
             f"(dp_replicate {d.dp_replicate} x dp_shard {d.dp_shard} x cp {d.cp} x tp {d.tp} x pp {d.pp}); "
             f"local batch {t.batch_size} x seq {t.seq_len}, {run.plan.grad_accum} micro-step(s), "
             f"AC {run.cfg.activation_checkpoint.mode}"]
    lines += [f"  note: {n}" for n in run.notes]
    for r in run.ranks:
        m = r.memory
        lines.append(f"{_rank_name(r)}: peak {m.peak_bytes / GIB:.2f} GiB tracked, in {m.peak_phase}"
                     f" [simulated in {r.seconds:.1f} s]")
        for c in CATEGORIES:
            if m.at_peak.get(c):
                lines.append(f"    {c:22s} {m.at_peak[c] / GIB:9.3f} GiB")
    # Every simulated rank's own table: pipeline stages differ in their blocks (DeepSeek-V3's first stage holds
    # the dense ones), so one rank's collectives, read as another's, are off by the ratio of their blocks.
    for r in run.ranks:
        lines += _collective_lines(r)
    return "\n".join(lines)


def _rank_name(r: RankRun) -> str:
    return f"rank {r.rank}" + (f" (pipeline stages {r.stages})" if r.stages else "")


def _collective_lines(r: RankRun) -> list[str]:
    lines = [f"collectives per step of {_rank_name(r)}, bytes per rank:",
             f"    {'dim':14s} {'kind':15s} {'phase':10s} {'count':>6s} {'GiB':>10s}"]
    for row in r.traffic.rows():
        lines.append(f"    {row['dim']:14s} {row['kind']:15s} {row['phase']:10s} {row['count']:6d} "
                     f"{row['bytes'] / GIB:10.4f}")
    return lines


def estimate_text(e: StepEstimate, cluster_name: str) -> str:
    # Of a pipeline, the rank of the highest peak and that of the longest step may differ: each figure names its own.
    lines = [f"On {cluster_name}: {'fits' if e.fits else 'DOES NOT FIT'} - peak {e.peak_memory_gib:.1f} GiB on rank "
             f"{e.worst_rank} ({e.tracked_peak_gib:.1f} tracked + {e.allowance_gib:.1f} allowance); largest: "
             f"{e.largest_consumer}",
             f"  step {e.step_time_s:.3f} s on rank {e.slowest_rank} = compute {e.compute_s:.3f} + exposed comm "
             f"{e.exposed_comm_s:.3f} + bubble {e.bubble_s:.3f}; bound by {e.bound}",
             f"  {e.tokens_per_second_per_gpu:,.0f} tokens/s per GPU, MFU {100 * e.mfu:.1f}%",
             f"  optimizer step {e.optimizer_s:.4f} s ({100 * e.optimizer_s / e.step_time_s:.2f}% of the step)",
             *_muon_lines(e), f"  communication per step of rank {e.slowest_rank}:"]
    for dim, nbytes in sorted(e.comm_bytes_per_step.items()):
        where = "crosses nodes" if e.crosses_nodes_by_dim.get(dim) else "within a node"
        lines.append(f"    {dim:14s} {nbytes / GIB:10.3f} GiB/rank {e.comm_s_by_dim.get(dim, 0.0):8.3f} s  ({where})")
    return "\n".join(lines)


def _muon_lines(e: StepEstimate) -> list[str]:
    """Muon by owners: the slowest owner's Newton-Schulz time, the owners' balance, and the naive layout's phase."""
    if not e.owner_imbalance:
        return []
    naive_step = e.step_time_s - e.optimizer_s + e.naive_optimizer_s
    return [f"  Muon: Newton-Schulz {e.newton_schulz_s:.4f} s ({100 * e.newton_schulz_s / e.step_time_s:.2f}% of the "
            f"step) on the most loaded owner, {e.owner_imbalance:.3f}x the mean; owner traffic "
            f"{e.optimizer_comm_bytes / GIB:.3f} GiB/rank",
            f"  Muon naive (every rank gathers and orthogonalizes every matrix): optimizer step "
            f"{e.naive_optimizer_s:.4f} s ({100 * e.naive_optimizer_s / naive_step:.2f}% of its step of "
            f"{naive_step:.3f} s; {100 * e.naive_optimizer_s / e.step_time_s:.1f}% of the owner layout's step), "
            f"all-gathers {e.naive_comm_bytes / GIB:.3f} GiB/rank"]
