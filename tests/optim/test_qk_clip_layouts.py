"""QK-clip on a sharded layout equals one process's: one gloo world of 4 ranks, TP 2 x FSDP 2, grouped-query attention
and MLA (with its low-rank query), under the document mask. Each data rank forwards its half of the batch, the
tensor-parallel ranks their half of the heads; the clip's one all-reduce makes the whole batch's per-head maxima,
and each rank scales the rows of its own shards. Two steps of measure-then-clip (a new batch each) against the same
on one process: the reduced tables and every weight equal."""

from __future__ import annotations

import logging

import pytest
import torch
from dist_harness import run_ranks
from torch import nn

from torchtitan.compat.mesh import REDISTRIBUTE_LOGGER
from torchtitan.models.attention import DocumentSDPA, GQAConfig, GroupedQueryAttention, build_document_mask
from torchtitan.models.deepseek_v3.mla import MLAConfig, MultiHeadLatentAttention
from torchtitan.models.layers import precompute_rope_cache
from torchtitan.optim.qk_clip import QKClip, attention_names

pytestmark = pytest.mark.slow  # starts a gloo world

B, L, DIM, HEADS, STEPS = 4, 8, 16, 4, 2
POSITIONS = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]] * 2 + [list(range(L))] * 2)  # rows 0-1: two documents


class _Model(nn.Module):
    """One GQA and one MLA module: two rows of the clip's table."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gqa = GroupedQueryAttention(GQAConfig(DIM, n_heads=HEADS, n_kv_heads=2, head_dim=8))
        self.mla = MultiHeadLatentAttention(MLAConfig(DIM, n_heads=HEADS, q_lora_rank=8, kv_lora_rank=8,
                                                      qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6,
                                                      norm_eps=1e-6, softmax_scale=0.3))
        for m in (self.gqa, self.mla):
            for lin in m.in_projections():
                nn.init.normal_(lin.weight, std=0.5)


def _batches() -> list[torch.Tensor]:
    torch.manual_seed(1)
    return [torch.randn(B, L, DIM) for _ in range(STEPS)]


def _steps(model: _Model, clip: QKClip, rows: slice) -> list[torch.Tensor]:
    """Measure (the forward of the batch's ``rows``) then clip, STEPS times; the reduced tables."""
    tables = []
    for x in _batches():
        documents = build_document_mask(POSITIONS[rows])
        with torch.no_grad():
            model.gqa(x[rows], precompute_rope_cache(8, L, 10000.0), backend=DocumentSDPA(), documents=documents)
            model.mla(x[rows], precompute_rope_cache(4, L, 10000.0), backend=DocumentSDPA(), documents=documents)
        for m in (model.gqa, model.mla):  # FSDP2 back to the shards, as after a backward: the clip scales those
            getattr(m, "reshard", lambda: None)()
        clip.step()
        assert clip.last is not None
        tables.append(clip.last.clone())
    return tables


def _threshold() -> float:
    """Between the heads' first maxima, so that some heads are clipped at the first step and some not."""
    model = _Model()
    clip = QKClip([model], attention_names(model), HEADS, threshold=1e9)
    first = _steps(model, clip, slice(None))[0]
    return float(first.flatten().sort().values[HEADS])


def _full(t: torch.Tensor) -> torch.Tensor:
    full_tensor = getattr(t, "full_tensor", None)
    return full_tensor() if full_tensor is not None else t


def _rank(rank: int, world_size: int, threshold: float) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import parallelize_module

    logging.getLogger(REDISTRIBUTE_LOGGER).setLevel(logging.ERROR)  # the check's full_tensor() of TP weights
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    model = _Model()
    for m in (model.gqa, model.mla):  # as models/common/parallel.py then distributed/fsdp.py
        parallelize_module(m, mesh["tp"], m.tp_plan(Replicate(), mesh["tp"]))
        fully_shard(m, mesh=mesh["dp_shard"])
    clip = QKClip([model], attention_names(model), HEADS, threshold, tp_mesh=mesh["tp"])
    half = mesh["dp_shard"].get_local_rank()
    tables = _steps(model, clip, slice(2 * half, 2 * half + 2))
    return {"tables": tables, "weights": {n: _full(p.detach()) for n, p in model.named_parameters()},
            "placements": str(tuple(model.gqa.wq.weight.placements))}


def test_clip_on_tp2_x_fsdp2_equals_one_process():
    threshold = _threshold()
    model = _Model()
    expected_tables = _steps(model, QKClip([model], attention_names(model), HEADS, threshold), slice(None))
    clipped = [int((t > threshold).sum()) for t in expected_tables]
    assert 0 < clipped[0] < 2 * HEADS, clipped  # some heads clipped, some not
    ranks = run_ranks(_rank, 4, threshold)
    assert ranks[0]["placements"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    for out in ranks:
        for got, expected in zip(out["tables"], expected_tables):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        for name, p in model.named_parameters():
            torch.testing.assert_close(out["weights"][name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
