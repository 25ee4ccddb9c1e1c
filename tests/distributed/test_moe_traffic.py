"""The all-to-all byte formula (torchtitan/models/moe/traffic.py) against the bytes a real 2-rank gloo world sends.

One world runs three tiny MoE layers with experts sharded over both ranks; the counter of
benchmarks/moe_traffic.py wraps ``all_to_all_single`` and adds the bytes each call's splits send
to the other rank. Balanced routing (each token's two experts on different ranks, by the router
bias) must give exactly ``all_to_all_bytes``, with and without activation recompute; the router's
own (uneven) routing must give exactly ``exact_all_to_all_bytes`` of the counts.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import load_script
from dist_harness import run_ranks

from torchtitan.models.moe.traffic import all_to_all_bytes, exact_all_to_all_bytes

TOKENS, DIM, EXPERTS, TOP_K = 6, 16, 4, 2


def _layer(balanced: bool, dtype: torch.dtype):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan.distributed.layout_init import init_params_layout_invariant
    from torchtitan.models.moe import MoE, MoEArgs
    from torchtitan.models.moe.parallel import apply_expert_parallel

    with torch.device("meta"):
        moe = MoE(MoEArgs(dim=DIM, hidden_dim=8, num_experts=EXPERTS, top_k=TOP_K, load_balance_bias=True))
    apply_expert_parallel(moe, init_device_mesh("cpu", (dist.get_world_size(),)))
    moe.to_empty(device="cpu")
    moe.init_buffers()
    init_params_layout_invariant(moe, 3)
    if balanced:  # experts 0 (rank 0) and 2 (rank 1) for every token: one pair each way per token
        bias = moe.router.expert_bias
        assert bias is not None
        bias.copy_(torch.tensor([1e3, -1e3, 1e3, -1e3]))
    return moe.to(dtype)


def _sent(rank: int, world_size: int) -> list[dict[str, Any]]:
    import torch.distributed as dist
    from torch.utils.checkpoint import checkpoint

    counting = load_script("benchmarks/moe_traffic.py").counting_all_to_all
    out = []
    for balanced, dtype, recompute in [(True, torch.float32, False), (True, torch.bfloat16, True),
                                       (False, torch.float32, False)]:
        moe = _layer(balanced, dtype)
        x = torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(rank)).to(dtype).requires_grad_(True)
        with counting() as counter:
            y = checkpoint(moe, x, use_reentrant=False) if recompute else moe(x)
            y.float().sum().backward()
        everyone = [torch.empty_like(moe.tokens_per_expert) for _ in range(world_size)]
        dist.all_gather(everyone, moe.tokens_per_expert)
        out.append(dict(sent=counter.rows + counter.counts, counts=[t.tolist() for t in everyone],
                        balanced=balanced, dtype_bytes=x.element_size(), recompute=recompute))
    return out


@pytest.fixture(scope="module")
def world() -> list[list[dict[str, Any]]]:
    return run_ranks(_sent, 2, timeout=120)


@pytest.mark.slow  # the two gloo ranks of ``world``
def test_balanced_routing_sends_exactly_the_formula(world):
    for rank, cases in enumerate(world):
        for case in (c for c in cases if c["balanced"]):
            expected = all_to_all_bytes(TOKENS, TOP_K, DIM, 2, case["dtype_bytes"], EXPERTS, case["recompute"])
            assert case["sent"] == expected, (rank, case)
            assert case["sent"] == exact_all_to_all_bytes(case["counts"], rank, DIM, case["dtype_bytes"],
                                                          case["recompute"])
    # Rows: tokens * top_k / 2 per exchange, 4 exchanges (6 with the recompute); counts: 2 int64 per forward.
    assert world[0][0]["sent"] == 4 * 6 * DIM * 4 + 2 * 8
    assert world[0][1]["sent"] == 6 * 6 * DIM * 2 + 2 * 2 * 8


@pytest.mark.slow
def test_uneven_routing_sends_exactly_the_count_of_its_routing(world):
    for rank, cases in enumerate(world):
        case = cases[2]
        assert case["sent"] == exact_all_to_all_bytes(case["counts"], rank, DIM, 4)
    uneven = world[0][2]["counts"]
    remote = [sum(uneven[r][2 - 2 * r:4 - 2 * r]) for r in range(2)]  # each rank's pairs to the other's experts
    assert remote != [TOKENS, TOKENS], "the router routed evenly: the case no longer tests an uneven split"


def test_formula_arguments():
    assert all_to_all_bytes(100, 2, 8, 1, 4, 8) == 0  # one rank: nothing leaves it
    assert all_to_all_bytes(100, 2, 8, 4, 2) == 4 * 100 * 2 * 0.75 * 8 * 2
    with pytest.raises(ValueError, match="ep=0"):
        all_to_all_bytes(100, 2, 8, 0, 2)
    with pytest.raises(ValueError, match="6 experts over 4 ranks"):
        exact_all_to_all_bytes([[1] * 6] * 4, 0, 8, 2)
