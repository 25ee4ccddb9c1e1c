"""Downstream scores in every layout equal a one-process brute-force reference to 1e-6.

The debug model trains 2 steps and scores two tasks after the second: the shipped
``continuation`` (3 requests) and a task file of this test (a context ending in a space, an
empty context, a context longer than ``seq_len`` that is cut from the left), 17 rows in all,
3 rows a forward per data-parallel rank, so the last batch is part padding. The layouts run in
one launch of 2 ranks (``eval_entry.py``): FSDP 2, TP 2 (loss parallel), PP 2 (the
forward-only pass) and CP 2 (each rank a share of every row). One process runs in this process.
Each layout saves its trained model; ``reference.py`` scores it one choice at a time, and every
score must match to 1e-6. The scores must also be what TensorBoard got, and each validation must
count the same bytes of text in every layout (CP ranks share their windows: counted once).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import DEBUG_CONFIG, debug_config, make_trainer
from reference import reference_model, reference_scores

from torchtitan.datasets import build_tokenizer
from torchtitan.distributed.layout_init import gather_full_state_dict
from torchtitan.distributed.lifecycle import shutdown_distributed
from torchtitan.downstream.tasks import load_tasks

pytestmark = pytest.mark.slow

STEPS, SEQ = 2, 64
REQUESTS = [
    {"context": "The value returned by the function is ", "choices": ["None", "a list", "an integer"], "label": 0},
    {"context": "", "choices": [" Return the sum of the arguments.", " Raise an error."], "label": 1},
    {"context": " ".join(f"word{i}" for i in range(80)) + " and then", "choices": [" stop", " go"], "label": 0},
]
LAYOUTS = {
    "FSDP 2": ["--parallelism.data_parallel_shard_degree=2", "--training.batch_size=1"],
    "TP 2": ["--parallelism.data_parallel_shard_degree=1", "--parallelism.tensor_parallel_degree=2",
             "--training.batch_size=2"],
    "PP 2": ["--parallelism.data_parallel_shard_degree=1", "--parallelism.pipeline_parallel_degree=2",
             "--training.batch_size=2"],
    "CP 2": ["--parallelism.data_parallel_shard_degree=1", "--parallelism.context_parallel_degree=2",
             "--training.batch_size=2"],
}
ONE = ["--parallelism.data_parallel_shard_degree=1", "--training.batch_size=2"]


def _common(task_file: Path) -> list[str]:
    return ["--job.config_file", DEBUG_CONFIG, f"--training.steps={STEPS}", f"--training.seq_len={SEQ}",
            "--lr_scheduler.warmup_steps=1", "--training.deterministic", "--job.print_args=false",
            "--metrics.log_freq=1000", "--validation.held_out_fraction=0.05", "--validation.enable",
            f"--validation.freq={STEPS}", "--validation.steps=1", f"--eval.tasks=continuation,{task_file}",
            "--eval.limit=3", f"--eval.freq={STEPS}", "--eval.batch_size=3"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
    from layout_entry import launch

    root = tmp_path_factory.mktemp("eval_layouts")
    task_file = root / "own_task.jsonl"
    task_file.write_text("".join(json.dumps(r) + "\n" for r in REQUESTS))
    common = _common(task_file)
    layouts = launch(Path(__file__).with_name("eval_entry.py"), root, common,
                     {name: {"overrides": o} for name, o in LAYOUTS.items()}, nproc=2, timeout=1200,
                     env={"OMP_NUM_THREADS": "1"})
    for i, name in enumerate(LAYOUTS):
        layouts[name]["model"] = root / f"run{i}" / "model.pt"
    # One process, in this one: the trainer directly.
    one = make_trainer(root / "one", *common[2:], *ONE)
    one.train()
    layouts["one process"] = {"scores": {str(s): v for s, v in one.eval_scores.items()},
                              "validation_bytes": {str(s): r.text_bytes for s, r in one.validation_results.items()},
                              "state": gather_full_state_dict(one.model_parts[0])}
    one.close()
    shutdown_distributed(ok=True, timeout_seconds=60)  # its one-rank group lives in this pytest process
    return {"layouts": layouts, "cfg": debug_config(*common[2:], *ONE)}


@pytest.mark.parametrize("name", ["one process", *LAYOUTS])
def test_scores_equal_the_brute_force_reference(runs, name):
    run, cfg = runs["layouts"][name], runs["cfg"]
    state = run["state"] if "state" in run else torch.load(run["model"])
    model = reference_model(cfg, state)
    tokenizer = build_tokenizer(cfg.model.tokenizer_path)
    expected: dict[str, float] = {}
    for task in load_tasks(cfg.eval, cfg.validation):
        expected.update(reference_scores(model, tokenizer, task, SEQ, positions=True))
    scores = run["scores"][str(STEPS)]
    assert list(run["scores"]) == [str(STEPS)]  # scored every freq steps only
    assert set(scores) == set(expected) and len(expected) == 6
    for key, value in expected.items():
        assert scores[key] == pytest.approx(value, abs=1e-6, rel=0), key
    if "tensorboard" in run:  # what the metrics logger wrote (float32)
        for key, value in scores.items():
            assert run["tensorboard"][key] == [pytest.approx(value, rel=1e-6)], key
        assert len(run["tensorboard"]["validation/bpb"]) == 1


def test_validation_counts_the_same_bytes_in_every_layout(runs):
    counted = {name: run["validation_bytes"] for name, run in runs["layouts"].items()}
    one = counted["one process"][str(STEPS)]
    assert one > 2 * SEQ  # two windows of text, a byte or more a token
    assert all(c == {str(STEPS): one} for c in counted.values()), counted
