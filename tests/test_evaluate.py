"""Validation on one process: what the loss means, what is logged, and the data errors of preflight.

Layout invariance (FSDP, HSDP, DDP, TP, CP, PP against one process) and "validation does
not disturb training" are checked inside the layout runs of tests/distributed/.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import DEBUG_CONFIG, debug_config, load_script
from dist_harness import run_ranks

from torchtitan.config import ConfigError

DEBUG = DEBUG_CONFIG
SEQ, BATCH = 16, 2


def _cfg(*overrides: str):
    return debug_config("--job.print_args=false", *overrides)


def _write_jsonl(path: Path, documents: list[str]) -> str:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents), encoding="utf-8")
    return str(path)


def _train_and_validate(rank: int, world_size: int, dump: str, data: str, documents: list[str]) -> dict:
    from torchtitan.datasets import build_tokenizer
    from torchtitan.datasets.documents import document_positions
    from torchtitan.trainer import Trainer

    cfg = _cfg(f"--job.dump_folder={dump}", "--training.steps=2", f"--training.seq_len={SEQ}",
               "--validation.enable", "--validation.freq=1", f"--validation.dataset_path={data}",
               f"--validation.batch_size={BATCH}", "--validation.steps=-1", "--metrics.enable_tensorboard")
    trainer = Trainer(cfg)
    trainer.train()
    # The reference: every complete batch of windows of the packed validation stream, scored at once.
    tokenizer = build_tokenizer(cfg.model.tokenizer_path)
    stream = [t for d in documents for t in tokenizer.encode(d, bos=True, eos=True)]
    windows = [stream[i * (SEQ + 1) : (i + 1) * (SEQ + 1)] for i in range(len(stream) // (SEQ + 1))]
    used = torch.tensor(windows[: len(windows) // BATCH * BATCH])
    model = trainer.model_parts[0].eval()
    with torch.no_grad():
        # Validation masks documents as training does (block_causal, the default): the reference too.
        logits = model(used[:, :-1], positions=document_positions(used[:, :-1], tokenizer.bos_id))
        reference = F.cross_entropy(logits.flatten(0, 1), used[:, 1:].flatten(), reduction="sum").double()
    model.train()
    out = {"validation": trainer.validation_losses, "reference": float(reference) / used[:, 1:].numel(),
           "tokens": used[:, 1:].numel(), "whole": trainer.validate()}
    trainer.validator.max_batches = 2
    out["two"] = trainer.validate()
    trainer.validator.max_batches = 10_000  # more than there are: the whole split, once
    out["more"] = trainer.validate()
    return out


@pytest.mark.slow
def test_validation_loss_is_the_mean_token_loss_of_the_split_and_is_logged(tmp_path):
    documents = [f"validation document {i}: " + "the quick brown fox jumps " * (i + 2) for i in range(12)]
    data = _write_jsonl(tmp_path / "val.jsonl", documents)
    (out,) = run_ranks(_train_and_validate, 1, str(tmp_path / "dump"), data, documents)
    whole = out["whole"]
    assert sorted(out["validation"]) == [1, 2]  # every step (freq 1), the last included
    assert whole.loss == pytest.approx(out["reference"], rel=1e-6) and whole.loss == out["validation"][2]
    assert whole.tokens == out["tokens"] and whole.batches == out["tokens"] // (BATCH * SEQ) > 2
    assert whole.perplexity == pytest.approx(math.exp(whole.loss))
    assert (out["two"].batches, out["two"].tokens) == (2, 2 * BATCH * SEQ)
    assert out["more"] == whole  # the same windows again: each evaluation starts from the beginning

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "dump" / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    scalars = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    assert scalars["validation/loss"] == pytest.approx(out["validation"])
    assert scalars["validation/perplexity"][2] == pytest.approx(math.exp(out["validation"][2]), rel=1e-5)
    assert scalars["validation/tokens"] == {1: out["tokens"], 2: out["tokens"]}
    # Training tokens before each validation: step x global batch (1 sequence) x seq_len.
    assert scalars["validation/train_tokens_seen"] == {1: SEQ, 2: 2 * SEQ}


def _preflight_error(world_size: int, *overrides: str) -> str:
    from torchtitan.preflight import preflight

    with pytest.raises(ConfigError) as info:
        preflight(_cfg("--validation.enable", *overrides), world_size)
    return str(info.value)


def test_preflight_rejects_validation_data_smaller_than_one_batch(tmp_path):
    # No process group exists here: preflight is what every rank runs before creating one.
    tiny = _write_jsonl(tmp_path / "tiny.jsonl", ["a short document " * 10])
    error = _preflight_error(2, f"--validation.dataset_path={tiny}")
    assert "fewer than one validation batch (--validation.batch_size=1 x data-parallel degree 2 = 2)" in error
    assert "make(s) 0 window(s) of 65 tokens" in error
    # A held-out part of 0.1% of the embedded corpus is far from 512 windows.
    error = _preflight_error(8, "--validation.held_out_fraction=0.001", "--validation.batch_size=64")
    assert "the held-out 0.001 of the training documents make(s)" in error
    assert "64 x data-parallel degree 8 = 512" in error
    assert "--validation.dataset=nope: unknown; choose one of embedded, c4" in _preflight_error(
        1, "--validation.dataset=nope")
    assert "no such file or folder" in _preflight_error(1, f"--validation.dataset_path={tmp_path / 'missing'}")
    # A hub validation set is streamed per rank, with no common end: it needs a number of batches.
    # (Only the checks run here: nothing is downloaded.)
    error = _preflight_error(1, "--validation.dataset=c4")
    assert "--validation.steps=-1 (the whole split) needs validation data in a token store" in error
    from torchtitan.preflight import preflight

    preflight(_cfg("--validation.enable", "--validation.dataset=c4", "--validation.steps=3"), 1)
    # A prepared training store lacks the held-out documents: say how to prepare them.
    prepare_main = load_script("scripts/prepare_data.py").main

    docs = _write_jsonl(tmp_path / "docs.jsonl", [f"document {i} " * 40 for i in range(200)])
    store = tmp_path / "store"
    prepare_main([docs, str(store), "--workers", "1", "--held-out-fraction", "0.1", "--no-progress"])
    error = _preflight_error(1, f"--training.dataset_path={store}", "--validation.held_out_fraction=0.1",
                             "--training.seq_len=16")
    assert f"--training.dataset_path={store} is a prepared token store" in error and "--held-out-side" in error
    held = tmp_path / "held"
    prepare_main([docs, str(held), "--workers", "1", "--held-out-fraction", "0.1", "--held-out-side", "--no-progress"])
    # Training reads the store without the held-out documents, validation the store of just those.
    both = ["--validation.enable", f"--training.dataset_path={store}", "--validation.held_out_fraction=0.1",
            "--training.seq_len=16"]
    preflight(_cfg(*both, f"--validation.dataset_path={held}"), 1)
    # A store of the documents held out by another split would overlap the training data.
    other = tmp_path / "other"
    prepare_main([docs, str(other), "--workers", "1", "--held-out-fraction", "0.2", "--held-out-side", "--no-progress"])
    error = _preflight_error(1, *both[1:], f"--validation.dataset_path={other}")
    assert "held out by held_out_fraction=0.2" in error and "this run holds out held_out_fraction=0.1" in error
    # Enough data: no error, and without --validation.enable the data is not read at all.
    preflight(_cfg("--validation.enable", f"--validation.dataset_path={tiny}", "--training.seq_len=8"), 1)
    preflight(_cfg(f"--validation.dataset_path={tmp_path / 'missing'}"), 1)
