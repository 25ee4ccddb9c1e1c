"""Document-masked attention under context parallelism equals one process (real gloo ranks, float64).

The windows place document boundaries inside CP chunks and let documents run across chunk
boundaries (and across ranks: rank r holds chunks r and 2cp-1-r), so only masks built from the
whole sequence's positions match. Forward outputs and parameter gradients (summed over the CP
ranks, as the data-parallel reduction does) must equal the unsharded model's.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from dist_harness import run_ranks
from torchtitan.distributed.context_parallel import shard_sequence
from torchtitan.models.attention import document_ids
from torchtitan.models.llama3 import ModelArgs, Transformer
from torchtitan.models.llama3.parallelize import apply_cp

L = 32
# Row 0: 3, 6, 2, 13 and 8 tokens; row 1: a document continued from the last window (16), 1 and 15 tokens.
DOCS = [[3, 6, 2, 13, 8], [16, 1, 15]]
POSITIONS = torch.tensor([[p for n in row for p in range(n)] for row in DOCS])


def _model() -> Transformer:
    torch.manual_seed(0)
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=61, max_seq_len=L)
    model = Transformer(args).double()
    model.init_weights()
    return model


def _cp_matches_one_process(rank: int, world_size: int) -> dict:
    model = _model()
    torch.manual_seed(1)
    tokens = torch.randint(0, 61, (2, L))
    weight = torch.randn(2, L, 61, dtype=torch.float64)
    full = model(tokens, positions=POSITIONS)
    (full * weight).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    cp_model = copy.deepcopy(model)
    cp_model.zero_grad()
    apply_cp(cp_model, init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",)), L)

    def shard(t: torch.Tensor) -> torch.Tensor:
        return shard_sequence(t, rank, world_size)

    out = cp_model(shard(tokens), positions=shard(POSITIONS))
    (out * shard(weight)).sum().backward()
    grads = {}
    for name, p in cp_model.named_parameters():
        dist.all_reduce(p.grad)
        grads[name] = float((p.grad - ref_grads[name]).abs().max() / ref_grads[name].abs().max())
    # Causal CP (the causal model's result) would differ: the mask matters at these boundaries.
    causal = float((full.detach() - model(tokens)).abs().max())
    return {"out": float((out.detach() - shard(full.detach())).abs().max()), "grads": grads, "causal": causal}


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_document_mask_matches_one_process(cp):
    # Boundaries inside chunks and documents across chunks, for cp=4's chunks of 4 tokens (cp=2: of 8).
    chunk = L // (2 * cp)
    starts = (POSITIONS == 0).nonzero().tolist()
    assert any(s % chunk for _, s in starts)
    docs = document_ids(POSITIONS)
    assert any(docs[0, c * chunk - 1] == docs[0, c * chunk] for c in range(1, 2 * cp))
    for r in run_ranks(_cp_matches_one_process, cp):
        assert r["out"] < 1e-12, r["out"]
        assert max(r["grads"].values()) < 1e-12, r["grads"]
        assert r["causal"] > 1e-3
