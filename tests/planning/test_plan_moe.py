"""The planner on mixture-of-experts jobs: the experts' all-to-all against the formula, the grouped GEMM's
FLOPs, the imbalance factor and its refusal, EP in --search, and the preflight's EP lines."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import REPO, debug_config, load_script

from torchtitan.config import ConfigManager
from torchtitan.planning import cli
from torchtitan.planning.compute import PhaseWork, grouped_mm_flops
from torchtitan.planning.dry_run import dry_run, dry_runs, plan_job
from torchtitan.planning.search import SearchBasis, candidate_overrides

MOE = str(REPO / "train_configs" / "qwen3_debug_moe.toml")
T, K, D, E, SPARSE_LAYERS = 64, 2, 256, 8, 3  # the debug MoE: seq 64 x batch 1; top-2 of 8; 3 of 4 layers MoE
BF16, INT64 = 2, 8


def _moe_cfg(*overrides: str):
    return debug_config("--metrics.enable_tensorboard=false", *overrides, config=MOE)


def _ep_rows(run) -> dict[str, dict]:
    return {r["phase"]: r for r in run.ranks[0].traffic.rows() if r["dim"] == "ep" and r["kind"] == "all_to_all"}


def _a2a_forward_bytes(tokens: int, imbalance: float, ep: int) -> int:
    """One rank, one MoE layer, one forward: the rows out and back (the larger of sent and received, in
    bf16), and the counts exchange (E int64)."""
    rows = tokens * K
    received = round(imbalance * rows / ep) * ep
    return 2 * max(rows, received) * D * BF16 + E * INT64


@pytest.fixture(scope="module")
def ep2_runs():
    # FSDP 4 with EP 2: the ep group (2 ranks) is not the dp_shard one, so the ledger names it
    cfg = _moe_cfg("--parallelism.data_parallel_shard_degree=4", "--parallelism.expert_parallel_degree=2")
    # EP 4 on TP 2 x FSDP 2 (EP borrowing TP's ranks) is simulated in the same pool of workers
    borrowed = _moe_cfg("--parallelism.data_parallel_shard_degree=2", "--parallelism.tensor_parallel_degree=2",
                        "--parallelism.expert_parallel_degree=4")
    balanced, borrowing = dry_runs([(cfg, 4, None), (borrowed, 4, None)])
    return balanced, dry_run(cfg, 4, moe_imbalance=1.5), borrowing


@pytest.mark.slow  # the dry run's pool of worker processes
def test_all_to_all_bytes_follow_the_formula(ep2_runs):
    balanced, skewed, _ = ep2_runs
    for run, f in ((balanced, 1.0), (skewed, 1.5)):
        rows = _ep_rows(run)
        assert rows["forward"]["bytes"] == SPARSE_LAYERS * _a2a_forward_bytes(T, f, 2), f
        assert rows["forward"]["count"] == SPARSE_LAYERS * 3
        # backward: the two row exchanges in reverse, no counts
        assert rows["backward"]["bytes"] == SPARSE_LAYERS * (_a2a_forward_bytes(T, f, 2) - E * INT64), f
    assert any("balanced" in n for n in balanced.notes) and any("imbalance 1.5" in n for n in skewed.notes)


@pytest.mark.slow
def test_all_to_all_bytes_under_tp_and_pp():
    """EP 2 x TP 2 x PP 2 x FSDP 2: a MoE layer is replicated over TP (each TP rank routes the whole
    sequence), and each stage exchanges for its own sparse layers, once per micro-batch."""
    cfg = _moe_cfg("--parallelism.data_parallel_shard_degree=2", "--parallelism.tensor_parallel_degree=2",
                   "--parallelism.pipeline_parallel_degree=2", "--parallelism.expert_parallel_degree=2",
                   "--parallelism.pipeline_parallel_schedule=1F1B", "--training.batch_size=2",
                   "--parallelism.pipeline_parallel_microbatches=2")
    run = dry_run(cfg, 8)
    for rank, sparse_layers in zip(run.ranks, (1, 2), strict=True):  # stage 0: layers 0 (dense) and 1
        rows = {r["phase"]: r for r in rank.traffic.rows() if r["dim"] == "ep" and r["kind"] == "all_to_all"}
        assert rows["forward"]["bytes"] == 2 * sparse_layers * _a2a_forward_bytes(T, 1.0, 2)
        assert rows["backward"]["bytes"] == 2 * sparse_layers * (_a2a_forward_bytes(T, 1.0, 2) - E * INT64)
        assert len(rank.traffic.group_ranks["ep"]) == 2


@pytest.mark.slow
def test_all_to_all_bytes_when_ep_borrows_tp(ep2_runs):
    """EP 4 on TP 2 x FSDP 2: each TP rank routes its own half of the sequence to the 4 ranks of its EP group."""
    run = ep2_runs[2]
    assert run.plan.dims.ep_borrows_tp
    rows = _ep_rows(run)
    assert rows["forward"]["bytes"] == SPARSE_LAYERS * _a2a_forward_bytes(T // 2, 1.0, 4)
    assert rows["backward"]["bytes"] == SPARSE_LAYERS * (_a2a_forward_bytes(T // 2, 1.0, 4) - E * INT64)
    assert run.ranks[0].traffic.group_ranks["ep"] == [0, 1, 2, 3]


def test_the_planner_takes_qwen3_235b_published_layout():
    """Qwen3-235B-A22B as Megatron-Bridge published it on 256 GPUs: TP 2 x EP 32 x PP 8 (dp_shard 16), EP borrowing
    TP's ranks; the planner's preflight (no dry run) accepts it, as ``benchmarks/plan_validation.py`` runs it."""
    cluster, world, overrides, *_ = load_script("benchmarks/plan_validation.py").MOE_ROWS[
        "qwen3-235b-a22b-tp2-ep32-pp8-vp4"]
    plan = plan_job(ConfigManager().parse_args(overrides), world)
    assert (plan.dims.tp, plan.dims.ep, plan.dims.pp, plan.dims.dp_shard) == (2, 32, 8, 16)
    assert plan.dims.ep_borrows_tp and plan.dims.degree("efsdp") == 1
    assert cluster == "h100-sxm-80g"


@pytest.mark.slow
def test_forward_matmul_flops_are_the_active_parameters(ep2_runs):
    balanced, skewed, _ = ep2_runs
    args = balanced.plan.model_args
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * T
    # flops_per_token counts every active parameter; the norms' (two per block, q/k norms, the final one)
    # do no matmul
    norms = args.n_layers * (2 * args.dim + 2 * args.head_dim) + args.dim
    active = (balanced.flops_per_token - attention) / 6 - norms  # the matmul parameters one token uses
    assert balanced.ranks[0].work["forward"].matmul_flops == 2 * T * active
    # the slowest rank's experts compute 1.5x the mean rows: their three grouped GEMMs grow by half
    expert_flops = SPARSE_LAYERS * 2 * T * K * 3 * D * args.moe_hidden_size
    assert skewed.ranks[0].work["forward"].matmul_flops == 2 * T * active + expert_flops // 2


def test_grouped_mm_flops_by_shape():
    assert grouped_mm_flops((10, 4), (3, 4, 6)) == 2 * 10 * 4 * 6  # forward / input gradient: rows split
    assert grouped_mm_flops((6, 10), (10, 4)) == 2 * 6 * 10 * 4  # weight gradient: the shared dim split
    assert grouped_mm_flops((3, 5, 4), (3, 4, 6)) == 2 * 3 * 5 * 4 * 6


def test_imbalance_below_one_is_refused_in_one_line(capsys):
    code = cli.plan_main(["--cluster", "h100-sxm-80g", "--world_size", "2", "--moe_imbalance", "0.8",
                          "--job.config_file", MOE])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--moe_imbalance=0.8" in err[0] and "at least 1" in err[0]


def test_preflight_refuses_an_ep_that_does_not_divide(capsys):
    code = cli.plan_main(["--cluster", "h100-sxm-80g", "--world_size", "8", "--job.config_file", MOE,
                          "--parallelism.expert_parallel_degree=3"])
    err = capsys.readouterr().err
    assert code == 2 and "config error:" in err and "expert_parallel_degree=3" in err
    # EP that needs TP's ranks but takes only half of them: the planner refuses it as a launch does.
    code = cli.plan_main(["--cluster", "h100-sxm-80g", "--world_size", "4", "--job.config_file", MOE,
                          "--parallelism.tensor_parallel_degree=4", "--parallelism.data_parallel_shard_degree=1",
                          "--parallelism.expert_parallel_degree=2"])
    err = capsys.readouterr().err
    assert code == 2 and "does not cover all of them" in err, err


def test_search_tries_ep_for_models_with_experts():
    def basis(cfg) -> SearchBasis:
        return SearchBasis.of(cfg.model, cfg.training, cfg.parallelism, 8)

    moe = candidate_overrides(basis(_moe_cfg()), 8, 8)
    eps = {o for layout in moe for o in layout if "expert_parallel_degree" in o}
    assert eps == {f"--parallelism.expert_parallel_degree={ep}" for ep in (1, 2, 4, 8)}
    dense = candidate_overrides(basis(debug_config("--metrics.enable_tensorboard=false")), 8, 8)
    assert not any("expert_parallel_degree" in o for layout in dense for o in layout)
    # the per-op 'moe' AC policy is a candidate for a model with experts only
    moe_ac = "--activation_checkpoint.selective_ac_option=moe"
    assert any(moe_ac in layout for layout in moe) and not any(moe_ac in layout for layout in dense)
    # 'exchange' too, under EP only (without it, it is full AC)
    exchange = [layout for layout in moe if "--activation_checkpoint.selective_ac_option=exchange" in layout]
    assert exchange and not any("--parallelism.expert_parallel_degree=1" in layout for layout in exchange)
    assert {o for layout in exchange for o in layout if "expert_parallel_degree" in o} == {
        f"--parallelism.expert_parallel_degree={ep}" for ep in (2, 4, 8)}
    ep8 = next(layout for layout in moe if "--parallelism.expert_parallel_degree=8" in layout)
    assert plan_job(_moe_cfg(*ep8), 8).dims.ep == 8  # what it proposes the preflight can take


DSV3 = str(REPO / "train_configs" / "deepseek_v3_debug.toml")
DSV3_SHARED_HIDDEN = 128  # the debug model's one shared expert: moe_hidden_size x num_shared_experts


@pytest.mark.slow  # the dry run's pool of worker processes
def test_overlapped_all_to_all_is_exposed_only_beyond_the_shared_experts():
    """EP 2 x FSDP 2 on the DeepSeek-V3 debug model (3 MoE layers with a shared expert): with
    ``--moe.overlap_all_to_all`` each layer's dispatch runs beside its shared expert, forward and backward; the
    cost model hides up to that compute of it, per all-to-all, never more than its time. Off: no cover, the old
    figure."""
    from torchtitan.planning import cost
    from torchtitan.planning.clusters import load_cluster

    def cfg(*more: str):
        return debug_config("--metrics.enable_tensorboard=false", "--parallelism.data_parallel_shard_degree=2",
                            "--parallelism.expert_parallel_degree=2", *more, config=DSV3)

    on, off = dry_runs([(cfg(), 2, None), (cfg("--moe.overlap_all_to_all=false"), 2, None)])
    h100 = load_cluster("h100-sxm-80g")
    one_per_node = dataclasses.replace(h100, gpus_per_node=1)  # EP over the network: slower than the cover
    shared_mm = 3 * 2 * T * D * DSV3_SHARED_HIDDEN  # the shared expert's three linears on the layer's T tokens
    for r_on, r_off in zip(on.ranks, off.ranks, strict=True):
        assert not r_off.traffic.covers, "without the overlap every all-to-all waits at once"
        assert r_on.traffic.rows() == r_off.traffic.rows()  # the same collectives, and the same work
        assert {p: w.as_tuple() for p, w in r_on.work.items()} == {p: w.as_tuple() for p, w in r_off.work.items()}
        covers = {(cover.key[2], PhaseWork(*cover.work).matmul_flops): n for cover, n in r_on.traffic.covers.items()}
        # forward: the shared expert's products beside the dispatch; backward: their gradients (twice the FLOPs)
        assert covers == {("forward", shared_mm): 3 * on.steps, ("backward", 2 * shared_mm): 3 * on.steps}, covers
        for c in (h100, one_per_node):
            ranks = r_on.traffic.group_ranks["ep"]
            hidden = sum(n * min(cost.collective_s("all_to_all", cover.nbytes, 1, ranks, c),
                                 cost.phase_compute_s(PhaseWork(*cover.work), c))
                         for cover, n in r_on.traffic.covers.items())
            exposed_on, exposed_off = cost._rank_times(on, r_on, c)[1], cost._rank_times(off, r_off, c)[1]
            assert hidden > 0 and exposed_on == pytest.approx(exposed_off - hidden, rel=1e-12, abs=1e-15)
            a2a = sum(cost.collective_s(row["kind"], row["bytes"], row["count"], ranks, c)
                      for row in r_on.traffic.rows() if row["kind"] == "all_to_all")
            assert 0 <= a2a - hidden < a2a  # never below zero: what is hidden is at most the all-to-alls' time
    # on NVLink the cover outlasts the exchange (all of the covered one is hidden); over the network it does not
    for c, clipped in ((h100, True), (one_per_node, False)):
        cover = next(iter(on.ranks[0].traffic.covers))
        t = cost.collective_s("all_to_all", cover.nbytes, 1, on.ranks[0].traffic.group_ranks["ep"], c)
        assert (cost.phase_compute_s(PhaseWork(*cover.work), c) >= t) is clipped, (c.name, c.gpus_per_node)


@pytest.mark.slow  # the dry run's pool of worker processes
def test_two_hop_dispatch_sends_each_token_once_per_node():
    """EP 4 x FSDP 4 on the DeepSeek-V3 debug model with ``--moe.dispatch_gpus_per_node=2`` (2 nodes of 2 ranks):
    the first hop runs over the ranks of the same local index on each node, the second over the node's ranks; a
    token crosses once per node its experts span (here one: the debug routing keeps one group of two, and the groups
    are the nodes), so the network carries half of what one hop sends over it, and its exposed time drops."""
    from torchtitan.models.moe.node_dispatch import nodes_per_token
    from torchtitan.planning import cost
    from torchtitan.planning.clusters import load_cluster

    def cfg(*more: str):
        return debug_config("--metrics.enable_tensorboard=false", "--parallelism.data_parallel_shard_degree=4",
                            "--parallelism.expert_parallel_degree=4", *more, config=DSV3)

    two, one = dry_runs([(cfg("--moe.dispatch_gpus_per_node=2"), 4, None), (cfg(), 4, None)])
    k, nodes, layers, float32 = 2, 2, 3, 4
    pairs = T * nodes_per_token(8, k, nodes, num_groups=2, topk_groups=1)
    assert pairs == T  # one node per token
    # per layer, forward: the pair counts, each pair's expert ids and weights, its row there and the sum back
    hop1 = nodes * INT64 + pairs * k * (INT64 + float32) + 2 * pairs * D * BF16
    bandwidth_only = dataclasses.replace(load_cluster("h100-sxm-80g"), gpus_per_node=2, network_latency_s=0.0,
                                         nvlink_latency_s=0.0)
    for r_two, r_one in zip(two.ranks, one.ranks, strict=True):
        rows = {(row["dim"], row["phase"]): row for row in r_two.traffic.rows() if row["kind"] == "all_to_all"}
        assert rows[("ep_inter_node", "forward")]["bytes"] == layers * hop1, rows
        me = r_two.traffic.group_ranks["ep_intra_node"]
        assert len(me) == 2 and me[0] // 2 == me[1] // 2, "the second hop stays in a node"
        inter = r_two.traffic.group_ranks["ep_inter_node"]
        assert len(inter) == 2 and inter[0] % 2 == inter[1] % 2 and inter[0] // 2 != inter[1] // 2
        one_hop = {row["phase"]: row["bytes"] for row in r_one.traffic.rows() if row["kind"] == "all_to_all"}
        assert one_hop["forward"] == layers * (2 * T * k * D * BF16 + 8 * INT64)  # each slot's row there and back
        # the exchanges' time at bandwidth (at these tiny sizes the latency of the more numerous hops would dominate)
        seconds = [sum(cost.collective_s("all_to_all", row["bytes"], row["count"], run.traffic.group_ranks[row["dim"]],
                                         bandwidth_only)
                       for row in run.traffic.rows() if row["kind"] == "all_to_all") for run in (r_two, r_one)]
        assert seconds[0] < 0.6 * seconds[1], seconds


def test_nodes_per_token_is_the_routings_average_span():
    """The planner's assumption for the two-hop dispatch: uniform routing over E experts on N nodes reaches
    N (1 - C(E - E/N, k) / C(E, k)) nodes (Qwen3-235B-A22B on 4 nodes: 3.62); group-limited routing whose groups sit
    in one node each reaches its topk_groups (DeepSeek-V3 on 8 nodes: 4), spread the same way over groups."""
    from math import comb

    from torchtitan.models.moe.node_dispatch import nodes_per_token

    uniform = nodes_per_token(128, 8, 4, num_groups=1, topk_groups=1)
    assert uniform == pytest.approx(4 * (1 - comb(96, 8) / comb(128, 8))) and uniform == pytest.approx(3.62, abs=0.01)
    assert nodes_per_token(256, 8, 8, num_groups=8, topk_groups=4) == 4
    assert nodes_per_token(256, 8, 4, num_groups=8, topk_groups=4) == pytest.approx(4 * (1 - comb(6, 4) / comb(8, 4)))
    assert nodes_per_token(256, 8, 1, num_groups=8, topk_groups=4) == 1  # one node: every token stays
