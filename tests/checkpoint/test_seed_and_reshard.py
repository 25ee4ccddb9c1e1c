"""Seed checkpoints and resharding resume: a checkpoint from one layout loads into another.

After a resharding load, the model and optimizer state must be bitwise what the
checkpoint holds (read back on one process as the truth), the data position must be
the global one, and the next losses must match a run that never stopped to the layout
parity tolerance (different layouts sum in different orders).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, SHIPPED_TOKENIZER
from dist_harness import run_ranks
from helpers import (
    DDP2,
    FSDP2,
    HSDP4,
    checkpoint_digests,
    copy_checkpoint,
    resume_and_inspect,
    train,
)

pytestmark = pytest.mark.slow  # every test here starts processes

PARITY = 1e-4  # relative, as in tests/distributed/test_layout_parity.py


def _assert_parity(losses: list[float], reference: list[float]) -> None:
    assert len(losses) == len(reference)
    for got, want in zip(losses, reference):
        assert abs(got - want) <= PARITY * abs(want), (losses, reference)


def _assert_loaded_exactly(result: dict, checkpoint) -> None:
    model, optim = checkpoint_digests(checkpoint)
    assert result["loaded"]["model"] == model
    assert result["loaded"]["optimizer"] == optim


def test_seed_checkpoint_script_reads_the_config_file_it_is_given(tmp_path):
    """--job.config_file given to the script is the config it reads, not a second file beside its default."""
    missing = tmp_path / "no_such_config.toml"
    script = REPO / "scripts" / "create_seed_checkpoint.sh"
    dump = f"--job.dump_folder={tmp_path / 'seed'}"
    out = subprocess.run(["bash", str(script), "--job.config_file", str(missing), dump],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHON": sys.executable})
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"config file '{missing}' not found" in out.stderr
    assert "2 times" not in out.stderr  # the script passed one file: the one it was given


def test_seed_checkpoint_starts_two_layouts_from_the_same_weights(tmp_path):
    seed_dump = tmp_path / "seed"
    out = subprocess.run(["bash", str(REPO / "scripts" / "create_seed_checkpoint.sh"), f"--job.dump_folder={seed_dump}",
                          "--job.print_args=false", "--metrics.enable_tensorboard=false", "--training.seed=42"],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ,
                              "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                              "PYTHON": sys.executable})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "step: 1" not in out.stderr  # it wrote the checkpoint and trained nothing
    seed = seed_dump / "checkpoint" / "step-0"
    manifest = json.loads((seed / "checkpoint.json").read_text())
    assert (manifest["kind"], manifest["states"], manifest["layout"]["world_size"]) == ("seed", ["model"], 1)
    seed_model, _ = checkpoint_digests(seed)

    curves = {}
    for name, ranks, layout in [("FSDP 2", 2, FSDP2), ("HSDP 2x2", 4, HSDP4)]:
        dump = tmp_path / name.replace(" ", "_")
        copy_checkpoint(seed_dump, 0, dump)
        # A different training seed: the weights must come from the seed checkpoint, not from init.
        result = run_ranks(resume_and_inspect, ranks, str(dump), [*layout, "--training.steps=2", "--training.seed=7"],
                           timeout=400)[0]
        assert result["loaded"]["step"] == 0
        assert result["loaded"]["model"] == seed_model
        assert result["loaded"]["optimizer"] == {}  # a fresh optimizer: a seed holds none
        curves[name] = result["losses"]
    _assert_parity(curves["HSDP 2x2"], curves["FSDP 2"])


def _train_save_and_resume_elsewhere(tmp_path, source: tuple[int, list[str]], target: tuple[int, list[str]],
                                     source_timeout: float = 400) -> dict:
    """Train 4 steps in ``source`` (ranks, overrides), saving at step 2; resume that checkpoint in
    ``target`` and check it loads exactly and steps 3-4 match the uninterrupted run. Returns the
    resumed run's result."""
    run = ["--training.steps=4", "--checkpoint.interval=2"]
    (source_ranks, source_overrides), (target_ranks, target_overrides) = source, target
    straight = run_ranks(train, source_ranks, str(tmp_path / "source"), [*source_overrides, *run],
                         timeout=source_timeout)[0]
    checkpoint = copy_checkpoint(tmp_path / "source", 2, tmp_path / "target")
    result = run_ranks(resume_and_inspect, target_ranks, str(tmp_path / "target"), [*target_overrides, *run],
                       timeout=400)[0]
    _assert_loaded_exactly(result, checkpoint)
    _assert_parity(result["losses"], straight["losses"][2:])
    return result


def test_fsdp8_to_hsdp_2x2(tmp_path):
    # 4 ranks with local batch 2: the same global batch of 8 over a DP degree of 4 instead of 8.
    result = _train_save_and_resume_elsewhere(
        tmp_path, (8, ["--parallelism.data_parallel_shard_degree=8", "--training.batch_size=1"]),
        (4, [*HSDP4[:2], "--training.batch_size=2"]), source_timeout=600)
    assert result["loaded"]["data"]["next_window"] == 2 * 8


def test_ddp_to_fsdp(tmp_path):
    _train_save_and_resume_elsewhere(tmp_path, (2, DDP2), (2, FSDP2))


def test_dp_degree_change_continues_the_global_stream(tmp_path):
    """FSDP 2 x batch 2 saves after 2 global batches of 4; one process with batch 2 continues at window 8."""
    source, target = tmp_path / "fsdp", tmp_path / "single"
    run_ranks(train, 2, str(source), [*FSDP2, "--training.steps=2", "--checkpoint.interval=2"], timeout=400)
    copy_checkpoint(source, 2, target)
    result = run_ranks(_first_batch_after_resume, 1, str(target), ["--training.batch_size=2", "--training.steps=4"])[0]
    assert result["next_window"] == 8
    assert result["first_batch"] == result["windows_8_9"]
    # A position does not map onto another held-out split, in either direction: a clear error on load.
    assert "taken with nothing held out but this run has held_out_fraction=0.1" in result["split_added"]
    assert "taken with held_out_fraction=0.1, split_seed=0 but this run has nothing held out" in result["split_dropped"]


def _first_batch_after_resume(rank: int, world_size: int, dump: str, overrides: list[str]) -> dict:
    from helpers import make_trainer

    trainer = make_trainer(dump, *overrides)
    trainer.checkpointer.load()
    position = trainer.dataloader.dataset.state_dict()["next_window"]
    inputs = next(iter(trainer.dataloader))[0]
    # The truth: windows 8 and 9 of the global stream, from a fresh dataset at the start.
    from torchtitan.datasets import DataLayout, build_dataloader, build_tokenizer

    fresh = build_dataloader(dataset_name="embedded", dataset_path=None,
                             tokenizer=build_tokenizer(SHIPPED_TOKENIZER),
                             layout=DataLayout(64, 10, 0, 1))
    first_ten, _ = next(iter(fresh))
    out = {"next_window": position, "first_batch": inputs.tolist(), "windows_8_9": first_ten[8:10].tolist()}

    def load_error(folder: str, *more: str) -> str:
        try:
            make_trainer(folder, *overrides, *more).checkpointer.load()
        except RuntimeError as e:
            return str(e)
        return "loaded"

    split = "--validation.held_out_fraction=0.1"
    out["split_added"] = load_error(dump, split)
    with_split = f"{dump}_split"
    make_trainer(with_split, *overrides, split, "--training.steps=2", "--checkpoint.interval=2").train()
    out["split_dropped"] = load_error(with_split)
    return out


TP2_FSDP2 = ["--parallelism.tensor_parallel_degree=2", "--parallelism.data_parallel_shard_degree=2",
             "--training.batch_size=2"]


def test_fsdp4_to_tp2_fsdp2(tmp_path):
    _train_save_and_resume_elsewhere(
        tmp_path, (4, ["--parallelism.data_parallel_shard_degree=4", "--training.batch_size=1"]), (4, TP2_FSDP2))


PP2_INTERLEAVED = ["--parallelism.pipeline_parallel_degree=2",
                   "--parallelism.pipeline_parallel_schedule=Interleaved1F1B",
                   "--parallelism.data_parallel_shard_degree=1", "--training.batch_size=4"]


def test_fsdp_to_pipeline_with_two_stages_per_rank_and_back(tmp_path):
    """Load into pipeline stages (two per rank, one optimizer over both), then save under PP and read it back."""
    source, target = tmp_path / "fsdp", tmp_path / "pp"
    run = ["--training.steps=4", "--checkpoint.interval=2"]
    straight = run_ranks(train, 2, str(source), [*FSDP2, *run], timeout=400)[0]
    checkpoint = copy_checkpoint(source, 2, target)
    results = run_ranks(resume_and_inspect, 2, str(target), [*PP2_INTERLEAVED, *run], timeout=400)
    model, optim = checkpoint_digests(checkpoint)
    # Each pipeline rank holds its own stages: together they loaded every tensor, bitwise.
    loaded_model = {k: v for r in results for k, v in r["loaded"]["model"].items()}
    loaded_optim = {k: v for r in results for k, v in r["loaded"]["optimizer"].items()}
    assert loaded_model == model and loaded_optim == optim
    assert not set(results[0]["loaded"]["model"]) & set(results[1]["loaded"]["model"])
    _assert_parity(results[0]["losses"], straight["losses"][2:])
    # The final save was written by the pipeline ranks; it holds every rank's stages and their optimizer state.
    final_model, final_optim = checkpoint_digests(target / "checkpoint" / "step-4")
    assert final_model == {k: v for r in results for k, v in r["weights"].items()}
    assert set(final_optim) == set(optim)
