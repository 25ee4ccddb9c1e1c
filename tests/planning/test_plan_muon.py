"""The planner prices Muon from its real step: the optimizer state (one momentum buffer per matrix), the owners'
gathers, scatters and HSDP broadcasts, the Newton-Schulz FLOPs, every owner's load (the slowest one priced) and
the naive layout (every rank gathering and orthogonalizing every matrix), each against arithmetic on the debug
model's shapes written here."""

from __future__ import annotations

import pytest
from conftest import debug_config

from torchtitan.planning.clusters import load_cluster
from torchtitan.planning.cost import collective_s, estimate, phase_compute_s
from torchtitan.planning.dry_run import dry_runs
from torchtitan.planning.report import estimate_text

pytestmark = pytest.mark.slow  # the dry run's pool of worker processes

# The debug model's matrices per block (dim 256, 16 heads of 16, 8 KV heads, FFN 768): wq, wk, wv, wo, w1, w2, w3;
# the embedding and the output head stay with AdamW.
BLOCK = [(256, 256), (128, 256), (128, 256), (256, 256), (768, 256), (256, 768), (768, 256)]
MATRICES = BLOCK * 6
FP32 = 4
NS_STEPS = 5


def _owners(ranks: int) -> list[int]:
    """Longest processing time first over m * n * min(m, n), to the least loaded rank (the lower one on a tie)."""
    load = [0] * ranks
    owners = [0] * len(MATRICES)
    costs = [m * n * min(m, n) for m, n in MATRICES]
    for i in sorted(range(len(MATRICES)), key=lambda i: -costs[i]):
        owners[i] = min(range(ranks), key=lambda r: (load[r], r))
        load[owners[i]] += costs[i]
    return owners


def _newton_schulz_flops(m: int, n: int) -> int:
    """Per step on the wide orientation (a x b, a <= b): X X^T (2 a^2 b), the Gram matrix squared (2 a^3) and the
    polynomial times X (2 a^2 b), as newton_schulz's three products."""
    a, b = min(m, n), max(m, n)
    return NS_STEPS * (4 * a * a * b + 2 * a ** 3)


@pytest.fixture(scope="module")
def runs():
    def job(optimizer: str, *layout: str):
        return debug_config(f"--optimizer.name={optimizer}", *layout), 4, None

    fsdp, hsdp = ["--parallelism.data_parallel_shard_degree=4"], ["--parallelism.data_parallel_shard_degree=2",
                                                                  "--parallelism.data_parallel_replicate_degree=2"]
    return dry_runs([job("AdamW", *fsdp), job("Muon", *fsdp), job("Muon", *hsdp)])


def _optimizer_rows(rank_run) -> dict[tuple[str, str], dict]:
    return {(r["dim"], r["kind"]): r for r in rank_run.traffic.rows() if r["phase"] == "optimizer"}


def test_muon_prices_its_state_traffic_and_newton_schulz(runs):
    adamw, muon, muon_hsdp = (run.ranks[0] for run in runs)
    whole = [m * n * FP32 for m, n in MATRICES]
    # State: AdamW keeps two moments and a step counter per matrix where Muon keeps one momentum buffer.
    saved = adamw.memory.final["optimizer"] - muon.memory.final["optimizer"]
    assert saved == sum(whole) // 4 + FP32 * len(MATRICES)
    # FSDP 4: rank 0 gathers onto itself the whole of what it owns and sends its quarter of the rest; the
    # scatter mirrors it.
    owners = _owners(4)
    mine = [i for i, o in enumerate(owners) if o == 0]
    expected = sum(w if o == 0 else w // 4 for w, o in zip(whole, owners))
    rows = _optimizer_rows(muon)
    for kind in ("gather", "scatter"):
        assert (rows[("dp_shard", kind)]["bytes"], rows[("dp_shard", kind)]["count"]) == (expected, len(MATRICES))
    ns = sum(_newton_schulz_flops(*MATRICES[i]) for i in mine)
    assert muon.work["optimizer"].matmul_flops == ns
    assert adamw.work["optimizer"].matmul_flops == 0
    # HSDP 2 x 2 (mesh [[0, 1], [2, 3]]): rank 0 gathers in its replica (ranks 0 and 1) what ranks 0 and 1 own,
    # and every matrix's half block comes to it by a broadcast from the owner's replica.
    rows = _optimizer_rows(muon_hsdp)
    in_replica = [(w, o) for w, o in zip(whole, owners) if o in (0, 1)]
    expected = sum(w if o == 0 else w // 2 for w, o in in_replica)
    for kind in ("gather", "scatter"):
        assert (rows[("dp_shard", kind)]["bytes"], rows[("dp_shard", kind)]["count"]) == (expected, len(in_replica))
    assert rows[("dp_replicate", "broadcast")]["bytes"] == sum(whole) // 2
    assert muon_hsdp.work["optimizer"].matmul_flops == ns
    # Priced: the optimizer phase takes at least the Newton-Schulz FLOPs at the matmul rate, plus the owner traffic.
    h100 = load_cluster("h100-sxm-80g")
    adamw_step, muon_step = estimate(runs[0], h100).optimizer_s, estimate(runs[1], h100).optimizer_s
    assert muon_step - adamw_step >= ns / (h100.peak_bf16_flops * h100.matmul_efficiency) > 0


def test_muon_prices_the_slowest_owner_and_the_naive_layout(runs):
    adamw, muon, muon_hsdp = runs
    flops = [_newton_schulz_flops(m, n) for m, n in MATRICES]
    loads = [0] * 4
    for f, o in zip(flops, _owners(4)):
        loads[o] += f
    whole = sum(m * n * FP32 for m, n in MATRICES)
    # FSDP 4 and HSDP 2 x 2 balance the same owners over the 4 ranks; the naive layout orthogonalizes every matrix on
    # every rank (4 times the mean load: the ranks' count) and all-gathers each whole over dp_shard.
    for run in (muon, muon_hsdp):
        work = run.ranks[0].muon
        assert (work.own_flops, work.max_flops, work.ranks) == (loads[0], max(loads), 4)
        assert work.mean_flops == sum(loads) / 4
        assert work.imbalance == pytest.approx(max(loads) * 4 / sum(loads)) and work.imbalance > 1
        assert work.naive_flops == sum(flops) == 4 * work.mean_flops
        assert work.naive_gathers == {"dp_shard": (whole, len(MATRICES))}
    assert adamw.ranks[0].muon is None
    # Priced: the step waits for the most loaded owner's Newton-Schulz; the naive phase swaps it for every matrix's
    # and the owners' gathers and scatters for the all-gathers.
    h100 = load_cluster("h100-sxm-80g")
    rate = h100.peak_bf16_flops * h100.matmul_efficiency
    rank = muon.ranks[0]
    ranks = rank.traffic.group_ranks
    owner_comm = sum(collective_s(r["kind"], r["bytes"], r["count"], ranks[r["dim"]], h100)
                     for r in rank.traffic.rows() if r["phase"] == "optimizer")
    e = estimate(muon, h100)
    assert e.newton_schulz_s == pytest.approx(max(loads) / rate)
    assert e.owner_imbalance == rank.muon.imbalance
    assert e.optimizer_s == pytest.approx(phase_compute_s(rank.work["optimizer"], h100) + (max(loads) - loads[0]) / rate
                                          + owner_comm)
    naive_comm = collective_s("all_gather", whole, len(MATRICES), ranks["dp_shard"], h100)
    naive_extra = (sum(flops) - max(loads)) / rate + naive_comm - owner_comm
    assert e.naive_optimizer_s - e.optimizer_s == pytest.approx(naive_extra)
    assert e.naive_comm_bytes == whole
    assert "most loaded owner" in estimate_text(e, "h100") and "naive" not in estimate_text(estimate(adamw, h100), "")
