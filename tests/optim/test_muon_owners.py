"""Muon on FSDP2, HSDP, DDP, EP and TP: the owner-based update equals one process's, each matrix orthogonalized once.

One gloo world of 4 ranks trains a small model as FSDP 4, HSDP 2x2 (also with the experts' rows cut), DDP 4,
EP 2 x FSDP 2, TP 2 x FSDP 2 and TP 2 x DP 2 in turn, for 3 steps on gradients that are a function of the
weights (the same in every layout), with the float32 iteration. Its matrices cover an uneven cut (5 rows on
4 ranks: one rank holds none), batched experts (whole on each rank under FSDP and EP: no communication), a
fused weight split in parts, a weight split in heads (``--optimizer.muon_split_heads``; its blocks cut across
heads), and TP's column-wise (rows cut on two mesh dimensions) and row-wise (rows and columns cut) weights.
"""

from __future__ import annotations

import logging

import pytest
import torch
from dist_harness import run_ranks
from torch import nn

from torchtitan.compat.mesh import REDISTRIBUTE_LOGGER
from torchtitan.optim.muon import Muon, MuonSettings
from torchtitan.optim.muon_owners import OwnerUpdate
from torchtitan.optim.muon_params import split_params

pytestmark = pytest.mark.slow  # starts a gloo world

STEPS = 3
FP32 = MuonSettings(ns_dtype="float32")
# DDP is FSDP2 on a (dp_replicate, dp_shard=1) mesh (distributed/fsdp.py): whole weights, one owner each.
LAYOUTS = {"FSDP 4": ((4,), ("dp_shard",)), "HSDP 2x2": ((2, 2), ("dp_replicate", "dp_shard")),
           "DDP 4": ((4, 1), ("dp_replicate", "dp_shard")),
           # as models/moe/parallel.py and distributed/fsdp.py: experts over ep, then FSDP over efsdp
           "EP 2 x FSDP 2": ((2, 2), ("efsdp", "ep")),
           # FSDP2 cuts the experts' rows when a rank's experts are fewer than its ranks (distributed/fsdp.py)
           "HSDP 2x2, expert rows cut": ((2, 2), ("dp_replicate", "dp_shard")),
           # as models/common/parallel.py then distributed/fsdp.py: TP over tp, FSDP2 over the data dims
           "TP 2 x FSDP 2": ((2, 2), ("dp_shard", "tp")),
           "TP 2 x DP 2": ((2, 1, 2), ("dp_replicate", "dp_shard", "tp"))}
# column-wise TP cuts the rows, row-wise the columns; fused's 10 rows on TP 2 split its parts (6 + 4) unevenly
TP_PLAN = {"up": "colwise", "narrow": "rowwise", "fused": "colwise"}
MATRICES = {"up.weight": 1, "narrow.weight": 1, "fused.weight": 1, "experts.w1": 4}  # name -> matrices


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok_embeddings = nn.Embedding(16, 8)
        self.up = nn.Linear(8, 12, bias=False)
        self.narrow = nn.Linear(12, 5, bias=True)  # 5 rows on 4 shards: 2, 2, 1, 0
        self.fused = nn.Linear(8, 10, bias=False)  # rows 6 + 4, orthogonalized apart
        self.experts = nn.Module()
        self.experts.w1 = nn.Parameter(torch.randn(4, 6, 8))
        self.norm = nn.RMSNorm(8)


def _optimizer(model: nn.Module, distributed: bool) -> Muon:
    groups = split_params([model])
    row_parts = {model.fused.weight: (6, 4), model.up.weight: (4,) * 3}  # up: 3 heads of 4 rows
    owners = OwnerUpdate(groups.matrices, groups.names, row_parts) if distributed else None
    return Muon(groups.matrices, groups.others, lr=0.02, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8,
                settings=FP32, row_parts=row_parts, orthogonalize=owners)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _train(model: nn.Module, optimizer: Muon) -> tuple[list[list[tuple[str, int, int]]], list[int]]:
    """What this rank orthogonalized at each step, and how many of those while its owner traffic travelled."""
    owned, overlapped = [], []
    for step in range(STEPS):
        for p in model.parameters():  # elementwise: a DTensor's gradient keeps its placements
            p.grad = torch.sin(p.detach() * (step + 1)) + 0.1 * step
        optimizer.step()
        owners = optimizer.orthogonalize
        owned.append(list(owners.owned_last_step) if isinstance(owners, OwnerUpdate) else [])
        overlapped.append(owners.overlapped_last_step if isinstance(owners, OwnerUpdate) else 0)
    return owned, overlapped


def _expert_parallel(experts: nn.Module, ep) -> None:  # noqa: ANN001 - a 1-D DeviceMesh
    """The experts cut on E over ``ep`` (models/moe/parallel.py), as DTensors FSDP2 then shards further."""
    from torch.distributed.tensor import DTensor, Shard

    per_rank = experts.w1.size(0) // ep.size()
    local = experts.w1.detach()[ep.get_local_rank() * per_rank:][:per_rank].clone()
    experts.w1 = nn.Parameter(DTensor.from_local(local, ep, [Shard(0)], run_check=False))


def _tensor_parallel(model: nn.Module, mesh) -> None:  # noqa: ANN001 - a DeviceMesh (..., tp)
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(model, mesh["tp"], {name: styles[style]() for name, style in TP_PLAN.items()})


def _rank(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    logging.getLogger(REDISTRIBUTE_LOGGER).setLevel(logging.ERROR)  # the check's full_tensor() of TP weights
    out = {}
    for name, (shape, dims) in LAYOUTS.items():
        model = _Model()
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=dims)
        if "tp" in dims:  # the experts over TP's ranks, as expert parallelism borrowing them does
            _tensor_parallel(model, mesh)
            _expert_parallel(model.experts, mesh["tp"])
            mesh = mesh[tuple(d for d in dims if d != "tp")]
        if "ep" in dims:
            _expert_parallel(model.experts, mesh["ep"])
            fully_shard(model.experts, mesh=mesh["efsdp"])
            mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
        if "rows" in name:
            fully_shard(model.experts, mesh=mesh, shard_placement_fn=lambda param: Shard(1))
        fully_shard(model, mesh=mesh)
        owned, overlapped = _train(model, _optimizer(model, distributed=True))
        out[name] = {"owned": owned, "overlapped": overlapped,
                     "final": {n: _full(p.detach()) for n, p in model.named_parameters()},
                     "experts": str(tuple(model.experts.w1.placements)),
                     "tp": {n: str(tuple(getattr(model, n).weight.placements)) for n in TP_PLAN}}
    return out


def test_owner_update_equals_one_process_in_fsdp_hsdp_ddp_ep_and_tp():
    model = _Model()
    _train(model, _optimizer(model, distributed=False))
    expected = dict(model.named_parameters())
    ranks = run_ranks(_rank, 4)
    assert ranks[0]["HSDP 2x2, expert rows cut"]["experts"] == "(Replicate(), Shard(dim=1))"
    assert ranks[0]["EP 2 x FSDP 2"]["experts"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    column, row = "(_StridedShard(dim=0, sf=2), Shard(dim=0))", "(Shard(dim=0), Shard(dim=1))"
    assert ranks[0]["TP 2 x FSDP 2"]["tp"] == {"up": column, "narrow": row, "fused": column}
    assert ranks[0]["TP 2 x DP 2"]["tp"]["narrow"] == "(Replicate(), " + row[1:]
    for layout in LAYOUTS:
        for name, final in ranks[0][layout]["final"].items():
            torch.testing.assert_close(final, expected[name].detach(), rtol=1e-5, atol=1e-6,
                                       msg=f"{layout}: {name}")
        for step in range(STEPS):  # each matrix (each expert) orthogonalized by exactly one rank
            owned = sorted((name, e) for r in ranks for name, first, stop in r[layout]["owned"][step]
                           for e in range(first, stop))
            assert owned == sorted((name, e) for name, n in MATRICES.items() for e in range(n)), (layout, step, owned)
        owners = {r for r, result in enumerate(ranks) if result[layout]["owned"][0]}
        assert len(owners) >= 3, f"{layout}: the cost heap spreads the matrices, owners {owners}"
        # the Newton-Schulz math runs while later gathers (or earlier scatters) travel, on some rank each step;
        # DDP gathers nothing (whole blocks), so it has nothing to overlap before its broadcast
        overlapped = [sum(r[layout]["overlapped"][step] for r in ranks) for step in range(STEPS)]
        assert layout == "DDP 4" or min(overlapped) > 0, f"{layout}: nothing overlapped its traffic {overlapped}"
