"""The planner and Float8: FP8 products at the cluster's FP8 peak, the casts' bytes, FP8 all-gathers at their size."""

from __future__ import annotations

import pytest
import torch
from conftest import CI_CONFIG

from torchtitan.compat import TorchDispatchMode
from torchtitan.config import ConfigManager
from torchtitan.planning.clusters import load_cluster
from torchtitan.planning.compute import ComputeLedger, PhaseWork
from torchtitan.planning.cost import phase_compute_terms
from torchtitan.planning.search import FLOAT8, SearchBasis, searched_overrides


class _Ledger(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ledger = ComputeLedger(phase="forward", recording=True)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ledger.on_op(func, args, kwargs, out)
        return out


@pytest.mark.parametrize(("recipe", "fp8_products"), [("tensorwise", 3), ("rowwise", 3), ("rowwise_with_gw_hp", 2)])
def test_float8_linear_products_are_counted_as_fp8(recipe, fp8_products):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    m, k, n = 32, 64, 128
    model = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False))
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe))
    x = torch.randn(m, k, requires_grad=True)
    with _Ledger() as mode:
        model(x).sum().backward()
    w = mode.ledger.work["forward"]
    assert w.matmul_flops == 3 * 2 * m * k * n  # forward, input gradient, weight gradient
    assert w.fp8_matmul_flops == fp8_products * 2 * m * k * n  # the weight gradient stays high precision
    assert w.memory_bytes > 0  # the casts: amax, scale, convert


def test_fp8_products_are_priced_at_the_fp8_peak():
    work = PhaseWork(matmul_flops=4 * 10**15, fp8_matmul_flops=3 * 10**15)
    h100, a100 = load_cluster("h100-sxm-80g"), load_cluster("a100-80g")
    assert h100.peak_fp8_flops == 1979e12  # the datasheet's dense FP8 rate
    terms = phase_compute_terms(work, h100)
    assert terms["matmul"] == pytest.approx(1e15 / (h100.peak_bf16_flops * h100.matmul_efficiency))
    assert terms["fp8 matmul"] == pytest.approx(3e15 / (h100.peak_fp8_flops * h100.matmul_efficiency))
    # An A100 has no FP8 tensor cores: its file gives no FP8 peak, and FP8 work runs at the bf16 rate.
    assert a100.peak_fp8_flops == 0
    assert phase_compute_terms(work, a100)["fp8 matmul"] == pytest.approx(
        3e15 / (a100.peak_bf16_flops * a100.matmul_efficiency))


def test_search_proposes_float8_only_where_asked_and_the_cluster_has_fp8():
    cfg = ConfigManager().parse_args(["--job.config_file", CI_CONFIG])
    job = SearchBasis.of(cfg.model, cfg.training, cfg.parallelism, 8)
    h100, a100 = load_cluster("h100-sxm-80g"), load_cluster("a100-80g")
    plain = searched_overrides(job, 8, h100, float8=False)
    with_fp8 = searched_overrides(job, 8, h100, float8=True)
    assert with_fp8 == [*plain, *([*o, *FLOAT8] for o in plain)]
    assert searched_overrides(job, 8, a100, float8=True) == searched_overrides(job, 8, a100, float8=False)


@pytest.mark.slow  # a dry run per config (seconds each; no process)
def test_dry_run_prices_fp8_all_gathers_at_their_size():
    from torchtitan.planning.dry_run import dry_run

    base = ["--job.config_file", CI_CONFIG, "--training.batch_size=1", "--parallelism.data_parallel_shard_degree=2"]
    fp8 = [*base, "--model.converters=float8"]
    runs = {name: dry_run(ConfigManager().parse_args(args), 2) for name, args in (
        ("bf16", base), ("fp8", fp8), ("fp8 gather", [*fp8, "--float8.enable_fsdp_float8_all_gather"]))}
    gathered = {name: sum(row["bytes"] for row in run.ranks[0].traffic.rows() if row["kind"] == "all_gather")
                for name, run in runs.items()}
    assert gathered["fp8"] == gathered["bf16"]  # Float8 linears alone gather what they hold (bf16)
    assert gathered["fp8 gather"] < 0.75 * gathered["bf16"]  # the converted weights travel in one byte
    work = {name: run.ranks[0].work["forward"] for name, run in runs.items()}
    assert work["bf16"].fp8_matmul_flops == 0 < work["fp8"].fp8_matmul_flops
    assert work["fp8"].memory_bytes > work["bf16"].memory_bytes  # the casts' bytes
