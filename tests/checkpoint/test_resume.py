"""Exact resume (FSDP, HSDP, DDP), preemption by SIGTERM, async saves, and the final weights-only export.

Every run trains the debug model in float32 on CPU/gloo with ``training.deterministic``.
A "straight" run trains 6 steps and saves step 3 along the way; a resumed run starts
from a copy of that step-3 checkpoint in a fresh folder, exactly what a run stopped
after step 3 leaves behind. Exact resume means the losses of steps 4-6 and the final
weights are bitwise those of the straight run.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from dist_harness import run_ranks
from helpers import (
    DDP2,
    FSDP2,
    HSDP4,
    checkpoint_tensors,
    copy_checkpoint,
    digest,
    full_model_digests,
    make_trainer,
    resume_and_inspect,
    rng_draws,
    train,
)

from torchtitan.train_step.callbacks import StepEvent, StepPoint

pytestmark = pytest.mark.slow  # every test here starts processes

RUN = ["--training.steps=6", "--checkpoint.interval=3"]


def _straight(tmp_path_factory, name: str, ranks: int, layout: list[str], extra: list[str] = ()) -> tuple:
    dump = tmp_path_factory.mktemp(name)
    return dump, run_ranks(train, ranks, str(dump), [*layout, *RUN, *extra], timeout=400)


@pytest.fixture(scope="module")
def fsdp_straight(tmp_path_factory):
    # Its final save is the weights-only export in bfloat16 (checked below); step 3 stays a full checkpoint.
    return _straight(tmp_path_factory, "fsdp", 2, FSDP2,
                     ["--checkpoint.model_weights_only", "--checkpoint.export_dtype=bfloat16"])


def _train_after_draws(rank: int, world_size: int, dump: str, overrides: list[str]) -> dict:
    trainer = make_trainer(dump, *overrides)
    # Move the generators away from their seeded state, so that a resume restores something
    # a fresh start would not reproduce (training itself draws no random numbers).
    rng_draws()
    losses = trainer.train()
    return {"losses": losses, "weights": full_model_digests(trainer), "rng_after": rng_draws()}


@pytest.fixture(scope="module")
def ddp_straight(tmp_path_factory):
    dump = tmp_path_factory.mktemp("ddp")
    return dump, run_ranks(_train_after_draws, 2, str(dump), [*DDP2, *RUN], timeout=400)


def _preempted(rank: int, world_size: int, dump: str, overrides: list[str], at_step: int, signalled: int) -> dict:
    trainer = make_trainer(dump, *overrides)

    def sigterm_at_step_end(event: StepEvent) -> None:
        if event.point is StepPoint.STEP_END and rank == signalled and event.step == at_step:
            # As a scheduler would: only this one rank is told, in the middle of the step.
            os.kill(os.getpid(), signal.SIGTERM)

    trainer.callbacks.add(sigterm_at_step_end)
    losses = trainer.train()
    # close() hands SIGTERM back to the handler that was there before (the default here).
    return {"losses": losses, "step": trainer.step,
            "handler_restored": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL}


def test_fsdp_sigterm_saves_then_resume_is_bitwise(fsdp_straight, tmp_path):
    straight_dump, straight = fsdp_straight
    reference = straight[0]["losses"]
    overrides = [*FSDP2, *RUN, "--checkpoint.interval=100", "--checkpoint.preemption_check_steps=2"]
    # SIGTERM reaches rank 1 only, during step 1: both ranks agree at the next check (step 2) to save
    # step 2 and stop cleanly.
    stopped = run_ranks(_preempted, 2, str(tmp_path), overrides, 1, 1, timeout=400)
    assert [r["step"] for r in stopped] == [2, 2]
    assert all(r["handler_restored"] for r in stopped)
    assert stopped[0]["losses"] == reference[:2]
    folder = tmp_path / "checkpoint"
    assert sorted(p.name for p in folder.iterdir()) == ["step-2"]
    assert json.loads((folder / "step-2" / "checkpoint.json").read_text())["kind"] == "full"

    resumed = run_ranks(train, 2, str(tmp_path), overrides, timeout=400)
    assert resumed[0]["losses"] == reference[2:]  # steps 3-6, bitwise
    assert resumed[1]["losses"] == reference[2:]
    assert resumed[0]["weights"] == straight[0]["weights"]


@pytest.mark.parametrize("layout", ["HSDP 2x2", "DDP 2"])
def test_exact_resume(layout, ddp_straight, tmp_path_factory, tmp_path):
    if layout == "DDP 2":
        (straight_dump, straight), ranks, overrides = ddp_straight, 2, DDP2
    else:
        (straight_dump, straight), ranks, overrides = _straight(tmp_path_factory, "hsdp", 4, HSDP4), 4, HSDP4
    copy_checkpoint(straight_dump, 3, tmp_path)
    resumed = run_ranks(resume_and_inspect, ranks, str(tmp_path), [*overrides, *RUN], timeout=400)
    assert resumed[0]["loaded"]["step"] == 3
    assert resumed[0]["loaded"]["data"]["next_window"] == 3 * 4  # global batch 4: the global position
    assert resumed[0]["losses"] == straight[0]["losses"][3:]  # bitwise
    assert resumed[0]["weights"] == straight[0]["weights"]
    if layout == "DDP 2":  # the straight run moved its generators before training: the resume restored them
        assert [r["rng_after"] for r in resumed] == [r["rng_after"] for r in straight]


def test_weights_only_export_loads_into_a_plain_model(fsdp_straight, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from torchtitan.checkpoint import export_model_weights
    from torchtitan.models.common.decoder import Decoder

    dump, straight = fsdp_straight
    final = dump / "checkpoint" / "step-6"
    manifest = json.loads((final / "checkpoint.json").read_text())
    assert (manifest["kind"], manifest["states"], manifest["dtype"]) == ("weights_only", ["model"], "bfloat16")
    tensors = checkpoint_tensors(final, "")
    assert tensors and all(k.startswith("model.") and v.dtype == torch.bfloat16 for k, v in tensors.items())

    trainer_args = _model_args()
    weights = export_model_weights(final, tmp_path / "model.pt")
    model = Decoder(trainer_args).to(torch.bfloat16)
    model.load_state_dict(torch.load(tmp_path / "model.pt"), strict=True)
    assert {fqn: digest(p) for fqn, p in model.named_parameters()} == straight[0]["weights_bf16"]
    assert weights.keys() == straight[0]["weights_bf16"].keys()

    # The documented one-liner gives the same tensors, nested under "model".
    dcp_to_torch_save(final, tmp_path / "plain.pt")
    plain = torch.load(tmp_path / "plain.pt")["model"]
    assert {fqn: digest(t) for fqn, t in plain.items()} == straight[0]["weights_bf16"]


def _model_args():
    import dataclasses

    from conftest import SHIPPED_TOKENIZER

    from torchtitan.datasets import build_tokenizer
    from torchtitan.models.llama3 import llama3_flavors

    tokenizer = build_tokenizer(SHIPPED_TOKENIZER)
    return dataclasses.replace(llama3_flavors["debugmodel"], vocab_size=tokenizer.n_words, max_seq_len=64)


def _train_counting_async(rank: int, world_size: int, dump: str, overrides: list[str]) -> dict:
    import torchtitan.checkpoint.saver as saver

    calls = []
    original = saver.dcp.async_save

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    saver.dcp.async_save = counting
    return {**train(rank, world_size, dump, overrides), "async_saves": len(calls)}


def test_async_save_resumes_bitwise_and_keeps_latest_k(tmp_path):
    straight_dump, resume_dump = tmp_path / "straight", tmp_path / "resumed"
    overrides = [*FSDP2, "--training.steps=6", "--checkpoint.interval=2", "--checkpoint.async_mode=async",
                 "--checkpoint.keep_latest_k=2"]
    straight = run_ranks(_train_counting_async, 2, str(straight_dump), overrides, timeout=400)
    assert straight[0]["async_saves"] == 2  # steps 2 and 4; the final save is synchronous
    # keep_latest_k=2 deleted step 2 once step 6 was committed; no leftover of an async save remains.
    assert sorted(p.name for p in (straight_dump / "checkpoint").iterdir()) == ["step-4", "step-6"]
    copy_checkpoint(straight_dump, 4, resume_dump)
    resumed = run_ranks(train, 2, str(resume_dump), overrides, timeout=400)
    # The async checkpoint holds step 4's state even though training went on while it was written.
    assert resumed[0]["losses"] == straight[0]["losses"][4:]
    assert resumed[0]["weights"] == straight[0]["weights"]



def test_muon_fsdp_resumes_bitwise(tmp_path_factory, tmp_path):
    """Muon through the trainer (docs/optimizers.md): FSDP 2's state through DCP (a sharded momentum per matrix,
    AdamW's moments for the rest) resumes bitwise from step 3. (FSDP 2 against one process, and this state
    resumed on other layouts: tests/optim/test_muon_layouts.py.)"""
    muon = ["--optimizer.name=Muon", "--optimizer.muon_ns_dtype=float32"]
    straight_dump, straight = _straight(tmp_path_factory, "muon", 2, FSDP2, muon)
    losses = straight[0]["losses"]
    copy_checkpoint(straight_dump, 3, tmp_path)
    resumed = run_ranks(resume_and_inspect, 2, str(tmp_path), [*FSDP2, *RUN, *muon], timeout=400)
    assert resumed[0]["loaded"]["step"] == 3
    assert resumed[0]["losses"] == losses[3:]  # bitwise
    assert resumed[0]["weights"] == straight[0]["weights"]
