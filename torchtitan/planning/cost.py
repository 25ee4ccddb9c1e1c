"""The step-time model: a dry run's work and traffic on a named cluster.

- Compute, per simulated rank and phase: matmul FLOPs at the achievable matmul rate; attention
  FLOPs (halved for causal kernels, which skip the masked half) at the attention kernel's rate;
  the bytes of every other kernel at the achievable HBM bandwidth; a launch cost per kernel.
- Communication, per collective: ring algorithms, ``latency + bytes x factor / bus bandwidth`` with
  factor (n-1)/n for all-gather and reduce-scatter, 2(n-1)/n for all-reduce, 1 for send/recv. The
  link is NVLink when the group's ranks share a node, else the network. An all-to-all (the experts'
  exchange on ``ep``) sends ``1/n`` of its bytes to each rank: those for the rank's node go over NVLink,
  the rest over the network, at once, so the slower share sets its time.
- Overlap: FSDP's (and HSDP's) all-gathers and reduce-scatters are prefetched and run beside the
  phase's compute, so only what exceeds it is exposed, plus the first all-gather and the last
  reduce-scatter of the phase; TP/SP and CP collectives sit on the critical path (eager PyTorch), so
  all of them are exposed, and so are the experts' all-to-alls (their split sizes are read on the
  host first, and the experts wait for the rows), except what ran between an all-to-all's issue and
  its wait (``--moe.overlap_all_to_all``: the shared experts beside the dispatch; the recorder's cover):
  each exposes max(0, its time - its cover's compute time); under PP the gradient reduce-scatters run
  after the schedule (exposed).
  Pipeline send/recv are asynchronous; their time counts as exposed only beyond the bubble.
- Pipeline bubble: the rank's idle time when the schedule's own action lists run with each stage's
  forward and backward per micro-batch (``pipeline_timeline.py``; ``pipeline.pipeline_bubble_s``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torchtitan.planning.clusters import Cluster
from torchtitan.planning.compute import PhaseWork
from torchtitan.planning.dry_run import DryRun, RankRun
from torchtitan.planning.memory import GIB
from torchtitan.planning.pipeline import pipeline_bubble_s
from torchtitan.planning.traffic import crosses_nodes

_FACTOR = {"all_gather": lambda n: (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
           "all_reduce": lambda n: 2 * (n - 1) / n, "broadcast": lambda n: 1.0, "all_to_all": lambda n: (n - 1) / n,
           "gather": lambda n: (n - 1) / n, "scatter": lambda n: (n - 1) / n,
           "send": lambda n: 1.0, "recv": lambda n: 0.0}  # a recv's bytes are its peer's send

# The stated allowance on top of the tracked peak: the caching allocator's fragmentation and
# reserve (a fraction of the peak) and NCCL's own buffers and the CUDA context (a fixed size).
ALLOCATOR_FRACTION = 0.10  # assumption: reserved/allocated of long training runs is 1.0-1.2; the middle
COMM_AND_CONTEXT_GIB = 2.0  # assumption: CUDA context (~0.5 GiB) and NCCL channel buffers per communicator


@dataclass
class StepEstimate:
    fits: bool
    peak_memory_gib: float  # the worst rank's tracked peak plus the allowance
    tracked_peak_gib: float
    allowance_gib: float
    largest_consumer: str
    step_time_s: float
    tokens_per_second_per_gpu: float
    mfu: float
    compute_s: float
    exposed_comm_s: float
    bubble_s: float
    comm_bytes_per_step: dict[str, int]
    comm_s_by_dim: dict[str, float] = field(default_factory=dict)
    crosses_nodes_by_dim: dict[str, bool] = field(default_factory=dict)
    bound: str = ""
    optimizer_s: float = 0.0  # of the step: the optimizer phase's compute and collectives (exposed) on the slowest rank
    optimizer_comm_bytes: int = 0  # the optimizer phase's collectives per rank (Muon's owner traffic)
    newton_schulz_s: float = 0.0  # Muon: the most loaded owner's Newton-Schulz time, which the step waits for
    owner_imbalance: float = 0.0  # Muon: the most loaded owner's Newton-Schulz work over the mean (0: no owners)
    naive_optimizer_s: float = 0.0  # Muon: the optimizer phase if every rank gathered and orthogonalized every matrix
    naive_comm_bytes: int = 0  # Muon: that layout's all-gathers per rank
    worst_rank: int = 0  # the simulated rank of the highest peak (the memory figures are its)
    slowest_rank: int = 0  # the simulated rank of the longest step (the time and traffic figures are its)

    def to_json(self) -> dict:
        keys = ("fits", "peak_memory_gib", "step_time_s", "tokens_per_second_per_gpu", "mfu", "compute_s",
                "exposed_comm_s", "bubble_s", "comm_bytes_per_step", "optimizer_s", "optimizer_comm_bytes",
                "newton_schulz_s", "owner_imbalance", "naive_optimizer_s", "naive_comm_bytes")
        out = {k: getattr(self, k) for k in keys}
        out.update(tracked_peak_gib=self.tracked_peak_gib, allowance_gib=self.allowance_gib,
                   largest_consumer=self.largest_consumer, bound=self.bound, comm_s_by_dim=self.comm_s_by_dim,
                   crosses_nodes_by_dim=self.crosses_nodes_by_dim)
        return out


def phase_compute_terms(w: PhaseWork, c: Cluster) -> dict[str, float]:
    """A phase's compute time on ``c`` by kind of work, in seconds (benchmarks/plan_by_kind.py prints them)."""
    attention = w.attention_flops - 0.5 * w.causal_attention_flops
    high_precision = w.matmul_flops - w.fp8_matmul_flops
    return {"matmul": high_precision / (c.peak_bf16_flops * c.matmul_efficiency),
            "fp8 matmul": w.fp8_matmul_flops / (c.fp8_flops * c.matmul_efficiency),
            "attention": attention / (c.peak_bf16_flops * c.attention_efficiency),
            "memory": w.memory_bytes / (c.hbm_bandwidth * c.hbm_efficiency),
            "launch": w.kernels * c.kernel_launch_s}


def phase_compute_s(w: PhaseWork, c: Cluster) -> float:
    return sum(phase_compute_terms(w, c).values())


def _matmul_s(flops: float, c: Cluster) -> float:
    return flops / (c.peak_bf16_flops * c.matmul_efficiency)


def owner_wait_s(run: DryRun, r: RankRun, c: Cluster) -> float:
    """Muon: how long ``r`` waits beyond its own Newton-Schulz work for the most loaded owner's (every update
    comes back in the scatters only when its owner is done), over the recorded steps."""
    return 0.0 if r.muon is None else _matmul_s(run.steps * (r.muon.max_flops - r.muon.own_flops), c)


def collective_s(kind: str, nbytes: int, count: int, ranks: list[int], c: Cluster) -> float:
    n = max(len(ranks), 1)
    if n == 1:
        return 0.0
    inter = crosses_nodes(ranks, c.gpus_per_node)
    bw, lat = (c.network_busbw, c.network_latency_s) if inter else (c.nvlink_busbw, c.nvlink_latency_s)
    if kind == "all_to_all":
        return count * lat + all_to_all_transfer_s(nbytes, ranks, c)
    return count * lat + nbytes * _FACTOR.get(kind, lambda n: 1.0)(n) / bw


def all_to_all_transfer_s(nbytes: int, ranks: list[int], c: Cluster) -> float:
    """An all-to-all of ``nbytes`` per rank: ``1/n`` to each rank, the node's share over NVLink and the rest
    over the network at the same time (the ranks of a group are placed on nodes in order)."""
    n = len(ranks)
    same_node = sum(r // c.gpus_per_node == ranks[0] // c.gpus_per_node for r in ranks)
    return max(nbytes * (same_node - 1) / n / c.nvlink_busbw, nbytes * (n - same_node) / n / c.network_busbw)


def _rank_times(run: DryRun, r: RankRun, c: Cluster) -> tuple[float, float, float, dict[str, float]]:
    """(compute, exposed communication, bubble, communication by dim) of one rank's step."""
    compute = {phase: phase_compute_s(w, c) for phase, w in r.work.items() if phase != "build"}
    if r.muon is not None:
        compute["optimizer"] = compute.get("optimizer", 0.0) + owner_wait_s(run, r, c)
    pp = run.dims.pp
    by_dim: dict[str, float] = {}
    fsdp_by_phase: dict[str, float] = {}
    fsdp_edges = exposed = 0.0
    blocks = _local_blocks(run, r)
    for row in r.traffic.rows():
        ranks = r.traffic.group_ranks.get(row["dim"], [])
        t = collective_s(row["kind"], row["bytes"], row["count"], ranks, c)
        by_dim[row["dim"]] = by_dim.get(row["dim"], 0.0) + t
        fsdp = row["via"] == "c10d" and row["dim"] != "pp" and row["kind"] != "all_to_all"  # FSDP2's own
        if fsdp and row["phase"] in ("forward", "backward") and pp == 1:
            fsdp_by_phase[row["phase"]] = fsdp_by_phase.get(row["phase"], 0.0) + t
            fsdp_edges += t / blocks  # the first gather / last reduce of a phase has nothing to hide behind
        elif fsdp and pp > 1 and row["kind"] == "all_gather":
            exposed += t / blocks  # gathered once per step (kept across micro-batches), prefetched after the first
        elif row["dim"] == "pp" and row["phase"] != "optimizer":
            continue  # asynchronous; hidden in the schedule (see below)
        elif row["kind"] == "all_to_all":
            exposed += t - _covered_s(r, row, ranks, c)
        else:
            exposed += t
    for phase, t in fsdp_by_phase.items():
        exposed += max(0.0, t - compute.get(phase, 0.0))
    exposed += fsdp_edges
    total_compute = sum(compute.values())
    bubble = 0.0
    if pp > 1:
        plan = run.plan.pipeline
        assert plan is not None, "pp > 1 has a pipeline plan"
        bubble = pipeline_bubble_s(plan, _pipeline_phase_s(run, c), r.coords.get("pp", 0))
        exposed += max(0.0, by_dim.get("pp", 0.0) - bubble)
    return total_compute, exposed, bubble, by_dim


def _pipeline_phase_s(run: DryRun, c: Cluster) -> dict[int, tuple[float, float]]:
    """pp rank -> (forward, backward) compute of its step, from the simulated rank that stands for it."""
    out: dict[int, tuple[float, float]] = {}
    for r in run.ranks:
        forward, backward = (phase_compute_s(r.work[p], c) if p in r.work else 0.0 for p in ("forward", "backward"))
        out.update(dict.fromkeys(r.stands_for or [r.coords.get("pp", 0)], (forward, backward)))
    return out


def _covered_s(r: RankRun, row: dict, ranks: list[int], c: Cluster) -> float:
    """The part of ``row``'s all-to-alls that ran beside compute (``TrafficLedger.covers``): each hides up to its
    cover's compute time, so its exposed time is max(0, its time - its cover's)."""
    key = (row["dim"], row["kind"], row["phase"], row["via"])
    return sum(n * min(collective_s(cover.key[1], cover.nbytes, 1, ranks, c),
                       phase_compute_s(PhaseWork(*cover.work), c))
               for cover, n in r.traffic.covers.items() if cover.key == key)


def _local_blocks(run: DryRun, r: RankRun) -> int:
    n = run.plan.model_args.n_layers
    if run.plan.pipeline is None:
        return n
    starts = run.plan.pipeline.layer_starts
    return max(1, sum(starts[s + 1] - starts[s] for s in r.stages))


def estimate(run: DryRun, c: Cluster) -> StepEstimate:
    """Step time, throughput and memory of ``run`` on cluster ``c`` (the slowest simulated rank sets the pace)."""
    times = [(_rank_times(run, r, c), r) for r in run.ranks]
    (compute, exposed, bubble, by_dim), slowest = max(times, key=lambda tr: sum(tr[0][:3]))
    step = compute + exposed + bubble
    tokens_per_gpu = run.tokens_per_step / run.world_size / step
    mfu = run.flops_per_token * tokens_per_gpu / c.peak_bf16_flops
    worst = run.worst
    tracked = worst.memory.peak_bytes / GIB
    allowance = tracked * ALLOCATOR_FRACTION + COMM_AND_CONTEXT_GIB
    split = worst.memory.at_peak
    largest = max(split, key=split.__getitem__)
    crossing = {d: crosses_nodes(ranks, c.gpus_per_node) for d, ranks in slowest.traffic.group_ranks.items()}
    bound = max([("compute", compute), ("bubble", bubble)]
                + [(f"communication ({d})", t) for d, t in by_dim.items() if exposed > 0.2 * step], key=lambda x: x[1])
    phase = _optimizer_phase(run, slowest, c)
    return StepEstimate(
        fits=tracked + allowance <= c.hbm_gib, peak_memory_gib=tracked + allowance, tracked_peak_gib=tracked,
        allowance_gib=allowance, largest_consumer=f"{largest} ({split[largest] / GIB:.1f} GiB)",
        step_time_s=step, tokens_per_second_per_gpu=tokens_per_gpu, mfu=mfu, compute_s=compute,
        exposed_comm_s=exposed, bubble_s=bubble, comm_bytes_per_step=slowest.traffic.by_dim(),
        comm_s_by_dim=by_dim, crosses_nodes_by_dim=crossing, bound=bound[0], optimizer_s=phase.seconds,
        optimizer_comm_bytes=phase.comm_bytes, newton_schulz_s=phase.newton_schulz_s,
        owner_imbalance=phase.owner_imbalance, naive_optimizer_s=phase.naive_s, naive_comm_bytes=phase.naive_comm_bytes,
        worst_rank=worst.rank, slowest_rank=slowest.rank)


@dataclass(frozen=True)
class _OptimizerPhase:
    seconds: float
    comm_bytes: int
    newton_schulz_s: float = 0.0
    owner_imbalance: float = 0.0
    naive_s: float = 0.0
    naive_comm_bytes: int = 0


def _optimizer_phase(run: DryRun, r: RankRun, c: Cluster) -> _OptimizerPhase:
    """The optimizer phase of ``r``'s step: its kernels (Muon's Newton-Schulz among them, the most loaded owner's)
    and its collectives, which nothing overlaps (``_rank_times`` counts them exposed); for Muon also the naive
    layout's phase: the same kernels with every matrix's Newton-Schulz, and all-gathers for the owners' traffic."""
    compute = phase_compute_s(r.work["optimizer"], c) if "optimizer" in r.work else 0.0
    compute += owner_wait_s(run, r, c)
    rows = [row for row in r.traffic.rows() if row["phase"] == "optimizer"]
    ranks = r.traffic.group_ranks
    comm = sum(collective_s(row["kind"], row["bytes"], row["count"], ranks.get(row["dim"], []), c) for row in rows)
    comm_bytes = sum(row["bytes"] for row in rows)
    if r.muon is None:
        return _OptimizerPhase(compute + comm, comm_bytes)
    newton_schulz = _matmul_s(run.steps * r.muon.max_flops, c)
    naive_comm = sum(collective_s("all_gather", run.steps * nbytes, run.steps * count, ranks.get(dim, []), c)
                     for dim, (nbytes, count) in r.muon.naive_gathers.items())
    naive = compute - newton_schulz + _matmul_s(run.steps * r.muon.naive_flops, c) + naive_comm
    return _OptimizerPhase(compute + comm, comm_bytes, newton_schulz, r.muon.imbalance, naive,
                           run.steps * sum(nbytes for nbytes, _ in r.muon.naive_gathers.values()))
