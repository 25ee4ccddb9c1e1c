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
from dist_harness import run_ranks
from torch.distributed.device_mesh import init_device_mesh

from torchtitan.distributed.context_parallel import shard_sequence
from torchtitan.models.attention import document_ids, select_backend
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.common.parallel import use_attention
from torchtitan.models.llama3 import ModelArgs

L = 32
# Row 0: 3, 6, 2, 13 and 8 tokens; row 1: a document continued from the last window (16), 1 and 15 tokens.
DOCS = [[3, 6, 2, 13, 8], [16, 1, 15]]
POSITIONS = torch.tensor([[p for n in row for p in range(n)] for row in DOCS])


def _model() -> Decoder:
    torch.manual_seed(0)
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=61, max_seq_len=L)
    model = Decoder(args).double()
    model.init_weights()
    return model


def _cp_matches_one_process(rank: int, world_size: int) -> dict:
    model = _model()
    # The one-process reference runs the kernels the CP run gets on CPU (the eager-CPU RoPE among them).
    model.use_attention_backend(select_backend("auto", "block_causal", "cpu", cpu_kernels=True))
    torch.manual_seed(1)
    tokens = torch.randint(0, 61, (2, L))
    weight = torch.randn(2, L, 61, dtype=torch.float64)
    full = model(tokens, positions=POSITIONS)
    (full * weight).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    cp_model = copy.deepcopy(model)
    cp_model.zero_grad()
    use_attention(cp_model, "auto", "cpu", init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",)), L)

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


@pytest.mark.slow
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


# ---- training through the Trainer: every layout trains what one process trains, under block_causal ----

STEPS = 3
RUN = [f"--training.steps={STEPS}", "--training.seq_len=32", "--validation.enable", "--validation.freq=1000",
       "--validation.held_out_fraction=0.1", "--validation.steps=1"]
# name -> overrides on 2 ranks; the global batch is 8 everywhere.
LAYOUTS = {
    "FSDP2, full AC, 2 accumulation steps": ["--parallelism.data_parallel_shard_degree=2", "--training.batch_size=2",
                                             "--training.gradient_accumulation_steps=2",
                                             "--activation_checkpoint.mode=full", "--validation.batch_size=4"],
    "TP2 (SP, loss parallel)": ["--parallelism.tensor_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1",
                                "--training.batch_size=8"],
    "CP2": ["--parallelism.context_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1",
            "--training.batch_size=8"],
    "PP2 1F1B": ["--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_schedule=1F1B",
                 "--parallelism.data_parallel_shard_degree=1", "--training.batch_size=8"],
}


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory) -> str:
    """A corpus of short documents (about 5-50 tokens): most windows of 32 tokens hold several."""
    import json
    import random

    rng = random.Random(0)
    words = "the a model trains on documents packed into windows each one attends only to itself".split()
    path = tmp_path_factory.mktemp("docs") / "short.jsonl"
    with open(path, "w") as f:
        for _ in range(600):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(2, 30)))}) + "\n")
    return str(path)


def _train(rank: int, world_size: int, dump: str, layouts: dict[str, list[str]]) -> dict:
    from test_layout_parity import make_trainer

    out = {}
    for i, (name, overrides) in enumerate(layouts.items()):
        trainer = make_trainer(f"{dump}/{i}", *RUN, *overrides)
        out[name] = {"losses": trainer.train(), "validation": trainer.validation_losses}
    return out


@pytest.mark.slow
def test_layouts_train_what_one_process_trains(short_documents, tmp_path):
    data = f"--training.dataset_path={short_documents}"
    (control,) = run_ranks(_train, 1, str(tmp_path / "control"),
                           {"one process": [data, "--training.batch_size=8"],
                            "causal": [data, "--training.batch_size=8", "--model.attn_mask_type=causal"]},
                           timeout=600)
    runs = run_ranks(_train, 2, str(tmp_path / "layouts"),
                     {name: [data, *overrides] for name, overrides in LAYOUTS.items()}, timeout=1200,
                     collective_timeout=300)
    reference = control["one process"]
    # The mask changes training on these windows (step 1 is the same: the init's logits barely depend on context).
    assert control["causal"]["losses"][1:] != reference["losses"][1:]
    for name in LAYOUTS:
        losses = runs[0][name]["losses"]
        assert runs[1][name]["losses"] == losses, name  # the logged loss is global
        rel = [abs(a - b) / abs(b) for a, b in zip(losses, reference["losses"])]
        assert rel[0] <= 1e-6 and max(rel) <= 1e-4, (name, rel)
        (val,), (ref,) = runs[0][name]["validation"].values(), reference["validation"].values()
        assert abs(val - ref) / ref <= 1e-4, (name, val, ref)
