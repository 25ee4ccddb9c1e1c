"""Reading tasks and refusing bad ones in preflight; the shipped ``continuation`` task."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from torchtitan.config import ConfigError, JobConfig
from torchtitan.datasets import Tokenizer, build_tokenizer
from torchtitan.downstream.build import EvalOptions, check_eval_tasks
from torchtitan.downstream.continuation import build_continuation_task, held_out_documents
from torchtitan.downstream.tasks import load_tasks, read_task_file

GOOD = {"context": "The cat", "choices": [" sat", " flew"], "label": 0}


def _write(path, *lines: object) -> str:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


def test_a_task_is_named_by_its_stem_and_limit_keeps_the_first(tmp_path):
    path = _write(tmp_path / "arc_easy.jsonl", GOOD, "", {**GOOD, "label": 1}, GOOD)
    task = read_task_file(path, limit=2)
    assert task.name == "arc_easy"
    assert [r.label for r in task.requests] == [0, 1]  # the blank line is skipped, the limit keeps two
    assert task.requests[0].choices == (" sat", " flew")


def _check(cfg: JobConfig, tokenizer: Tokenizer) -> list[str]:
    return check_eval_tasks(EvalOptions.of(cfg.eval, cfg.validation, cfg.training, cfg.model), tokenizer)


@pytest.fixture(scope="module")
def tokenizer(shipped_tokenizer):
    return build_tokenizer(shipped_tokenizer)


@pytest.mark.parametrize("lines, expected", [
    ([GOOD, "{not json"], "line 2: not JSON"),
    ([{"context": "x", "choices": [" a", " b"]}], "line 1: missing label"),
    ([{**GOOD, "label": 2}], "line 1: label 2 is out of range for 2 choices"),
    # Issue 60: a boolean was "out of range" for 2 choices; it is refused for what it is, with what to give.
    ([{**GOOD, "label": True}], "label true is a boolean, not a choice's index; give the index of the right "
                                "choice, an integer 0..1"),
    ([{**GOOD, "label": "1"}], 'label "1" is not an integer; give the index of the right choice, an integer 0..1'),
    ([{**GOOD, "choices": [" a"]}], "at least two non-empty strings"),
    ([{**GOOD, "context": 3}], "context must be a string"),
])
def test_a_malformed_line_is_one_line_naming_file_and_line(tmp_path, debug_cfg, tokenizer, lines, expected):
    path = _write(tmp_path / "bad.jsonl", *lines)
    problems = _check(debug_cfg(f"--eval.tasks={path}"), tokenizer)
    assert len(problems) == 1 and "\n" not in problems[0]
    assert expected in problems[0] and "bad.jsonl" in problems[0], problems


def test_missing_file_unknown_name_duplicate_and_too_long_are_refused(tmp_path, debug_cfg, tokenizer):
    def problem(*overrides: str) -> str:
        (line,) = _check(debug_cfg(*overrides), tokenizer)
        return line

    assert "not found" in problem(f"--eval.tasks={tmp_path}/nope.jsonl")
    assert "unknown task 'hellaswag'" in problem("--eval.tasks=hellaswag")
    twin = tmp_path / "twin"
    twin.mkdir()
    a, b = _write(tmp_path / "q.jsonl", GOOD), _write(twin / "q.jsonl", GOOD)
    assert "two tasks are named 'q'" in problem(f"--eval.tasks={a},{b}")
    long = _write(tmp_path / "long.jsonl", {**GOOD, "choices": [" word" * 80, " b"]})
    assert "more than --training.seq_len=64" in problem(f"--eval.tasks={long}")
    # The shipped task's passages would be trained on: the embedded corpus without a held-out split.
    assert "--validation.held_out_fraction" in problem("--eval.tasks=continuation")
    assert _check(debug_cfg(f"--eval.tasks={a}"), tokenizer) == []


def test_preflight_refuses_a_bad_task_before_any_process_group(tmp_path, debug_cfg):
    from torchtitan.preflight import preflight

    path = _write(tmp_path / "t.jsonl", {**GOOD, "label": 5})
    with pytest.raises(ConfigError) as info:
        preflight(debug_cfg(f"--eval.tasks={path}"), 1)
    assert len(info.value.problems) == 1 and "label 5 is out of range" in info.value.problems[0]


def test_continuation_is_built_from_held_out_passages_each_the_answer_once(debug_cfg):
    cfg = debug_cfg("--validation.held_out_fraction=0.05", "--eval.tasks=continuation", "--eval.limit=40")
    (task,) = load_tasks(cfg.eval, cfg.validation)
    assert task.name == "continuation" and len(task.requests) == 40
    held_out = held_out_documents(cfg.validation)
    golds = [r.choices[r.label] for r in task.requests]
    for request in task.requests:
        assert len(request.choices) == 4 and all(c.startswith(" ") for c in request.choices)
        # Context and answer are consecutive text of one held-out document.
        assert any(request.context + request.choices[request.label] in doc for doc in held_out)
    # Every wrong choice is the answer of another kept request: a context-blind scorer stays at chance.
    wrong = Counter(c for r in task.requests for i, c in enumerate(r.choices) if i != r.label)
    assert set(wrong) <= set(golds) and sum(wrong.values()) == 3 * 40
    # The answer's place varies, and the task is the same when built again.
    assert len({r.label for r in task.requests}) == 4
    assert build_continuation_task(cfg.validation, 40) == task
