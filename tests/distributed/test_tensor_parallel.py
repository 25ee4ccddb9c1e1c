"""TP-sharded Llama modules equal the unsharded ones, forward and backward (real gloo ranks).

Every rank builds the same full model (same seed), keeps one copy as the
reference and parallelizes another with ``apply_tp``; the logits, the loss and
every parameter gradient (gathered from its shards) must match the reference.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from dist_harness import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils._python_dispatch import TorchDispatchMode

from torchtitan.distributed.grads import match_grad_placements
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.common.parallel import apply_tp
from torchtitan.models.llama3 import ModelArgs

pytestmark = pytest.mark.slow  # every test here starts processes

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=128, multiple_of=32, max_seq_len=16)


class _CollectiveCounter(TorchDispatchMode):
    """Counts the collectives a rank issues, by kind, once DTensor has turned its ops into them.

    Only collectives whose input holds more than ``min_numel`` elements are counted: the
    activation traffic, not the per-token statistics of loss parallel.
    """

    KINDS = {"all_reduce": "all_reduce", "allreduce_": "all_reduce", "all_gather_into_tensor": "all_gather",
             "reduce_scatter_tensor": "reduce_scatter"}

    def __init__(self, min_numel: int) -> None:
        super().__init__()
        self.min_numel, self.counts = min_numel, Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        kind = self.KINDS.get(func._opname) if func.namespace in ("c10d", "_c10d_functional") else None
        if kind:
            first = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
        if kind and isinstance(first, torch.Tensor) and first.numel() > self.min_numel:
            self.counts[kind] += 1
        return func(*args, **(kwargs or {}))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _compare(rank: int, world_size: int, sequence_parallel: bool, use_loss_parallel: bool) -> dict:
    torch.manual_seed(0)
    reference = Decoder(ARGS)
    reference.init_weights()
    sharded = copy.deepcopy(reference)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    apply_tp(sharded, mesh, sequence_parallel=sequence_parallel, loss_parallel=use_loss_parallel)

    tokens = torch.randint(0, ARGS.vocab_size, (2, ARGS.max_seq_len))
    labels = torch.randint(0, ARGS.vocab_size, (2, ARGS.max_seq_len))
    ref_logits = reference(tokens)
    ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten(), reduction="sum")
    ref_loss.backward()

    # Activation collectives move at least one rank's slice of the sequence: B * L/tp * dim elements.
    activation_counter = _CollectiveCounter(min_numel=tokens.numel() * ARGS.dim // world_size - 1)
    with activation_counter:
        logits = sharded(tokens)
        placements = logits.placements if isinstance(logits, DTensor) else None
        if use_loss_parallel:
            with loss_parallel():
                loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
                loss.backward()
        else:
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
            loss.backward()
    grad_placements_before = {fqn: p.grad.placements for fqn, p in sharded.named_parameters()
                              if isinstance(p, DTensor) and p.grad.placements != p.placements}
    settle_counter = _CollectiveCounter(min_numel=0)
    with settle_counter:
        match_grad_placements(sharded.parameters())

    ref_grads = dict(reference.named_parameters())
    grad_err = {fqn: float((_full(p.grad) - ref_grads[fqn].grad).abs().max()) for fqn, p in sharded.named_parameters()}
    sharded_params = {fqn: p.placements for fqn, p in sharded.named_parameters() if isinstance(p, DTensor)}
    return {
        "logits_err": float((_full(logits.detach()) - ref_logits.detach()).abs().max()),
        "loss_err": float(abs(float(_full(loss.detach())) - float(ref_loss))),
        "loss": float(ref_loss),
        "grad_err": grad_err,
        "logit_placements": placements,
        "placements": sharded_params,
        "activation_comms": dict(activation_counter.counts),
        "settle_comms": dict(settle_counter.counts),
        "mismatched_before": grad_placements_before,
        "mismatched_after": [fqn for fqn, p in sharded.named_parameters()
                             if isinstance(p, DTensor) and p.grad.placements != p.placements],
    }


@pytest.mark.parametrize(
    "world_size,sequence_parallel,use_loss_parallel",
    [(2, True, True), (2, False, False), (2, True, False), (4, True, True)],
)
def test_tp_model_matches_unsharded(world_size, sequence_parallel, use_loss_parallel):
    results = run_ranks(_compare, world_size, sequence_parallel, use_loss_parallel)
    for r in results:
        assert r["logits_err"] < 1e-5
        assert r["loss_err"] < 1e-4 * r["loss"]
        assert max(r["grad_err"].values()) < 1e-5, r["grad_err"]
        assert len(r["grad_err"]) == len(list(Decoder(ARGS).parameters()))
    p = results[0]["placements"]
    # Megatron layout: column-parallel in-projections, row-parallel out-projections, vocab-sharded embeddings.
    for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
        assert p[f"layers.0.{name}.weight"] == (Shard(0),), name
    for name in ("attention.wo", "feed_forward.w2"):
        assert p[f"layers.0.{name}.weight"] == (Shard(1),), name
    assert p["tok_embeddings.weight"] == (Shard(0),)
    assert p["output.weight"] == (Shard(0),)
    # Norm weights become (replicated) DTensors only under sequence parallelism.
    assert ("layers.0.attention_norm.weight" in p) == sequence_parallel
    if sequence_parallel:
        assert p["norm.weight"] == (Replicate(),)
    # Loss parallel leaves the logits sharded over the vocabulary; otherwise they are plain tensors.
    assert results[0]["logit_placements"] == ((Shard(2),) if use_loss_parallel else None)

    # Activation traffic per forward + backward, Megatron's count: each block has 2 TP regions,
    # each with one collective in forward and its transpose in backward; the embedding and
    # the output projection add one pair each. With SP that is all-gather/reduce-scatter pairs,
    # without SP all-reduces. Anything more means a region gathers or reduces twice.
    regions = 4 * ARGS.n_layers + 2
    comms = results[0]["activation_comms"]
    if sequence_parallel:
        assert comms.get("all_reduce", 0) == 0, comms
        # Without loss parallel the output all-gathers the vocab-sharded logits (and their grad is sliced).
        assert comms["reduce_scatter"] == regions, comms
        assert comms["all_gather"] == regions + (0 if use_loss_parallel else 1), comms
    else:
        assert comms["all_reduce"] == regions, comms
        assert comms.get("reduce_scatter", 0) == 0, comms

    # Without FSDP, autograd leaves the SP-replicated norm weights with Partial gradients and the
    # row-sharded embedding with a whole (Replicate) gradient; match_grad_placements settles both,
    # with exactly one all-reduce per norm weight and none for the embedding (a local slice).
    before = results[0]["mismatched_before"]
    assert before.get("tok_embeddings.weight") == (Replicate(),), before
    if sequence_parallel:
        assert all(before[f"layers.{i}.{n}.weight"] == (Partial(),) for i in range(ARGS.n_layers)
                   for n in ("attention_norm", "ffn_norm")), before
        assert results[0]["settle_comms"] == {"all_reduce": 2 * ARGS.n_layers + 1}
    else:
        assert results[0]["settle_comms"] == {}
    assert all(r["mismatched_after"] == [] for r in results)
