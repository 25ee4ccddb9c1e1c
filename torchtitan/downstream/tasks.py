"""Multiple-choice tasks: what a request is, how a JSONL task file is read, and how ``[eval] tasks`` names resolve.

A task file holds one request a line, ``{"context": str, "choices": [str, ...], "label": int}``:
the context, the candidate continuations, and the index of the right one. A task is named by
its file's stem (``arc_easy.jsonl`` is ``arc_easy``). A name without a path separator or a
``.jsonl`` ending is a shipped task (``SHIPPED``), built by the project from its own data.

Every problem with a file is a ``TaskError`` whose message is one line naming the file, the
line and the fix; preflight collects them on every rank before any process group exists.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

from torchtitan.config.job_config import JobConfig


class TaskError(ValueError):
    """A task that cannot be read: one line naming the file (or name), what is wrong and the fix."""


@dataclasses.dataclass(frozen=True)
class Request:
    """One multiple-choice question: a context and its candidate continuations, ``label`` the right one."""

    context: str
    choices: tuple[str, ...]
    label: int


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    requests: tuple[Request, ...]


def parse_request(line: str, where: str) -> Request:
    """One JSONL line as a request; ``where`` (file:line) leads the error."""
    try:
        item = json.loads(line)
    except json.JSONDecodeError as e:
        raise TaskError(f"{where}: not JSON ({e.msg}); each line is one "
                        '{"context": str, "choices": [str, ...], "label": int}') from e
    if not isinstance(item, dict):
        raise TaskError(f"{where}: a JSON object is expected, got {type(item).__name__}")
    missing = [key for key in ("context", "choices", "label") if key not in item]
    if missing:
        raise TaskError(f"{where}: missing {', '.join(missing)}; each line is one "
                        '{"context": str, "choices": [str, ...], "label": int}')
    context, choices, label = item["context"], item["choices"], item["label"]
    if not isinstance(context, str):
        raise TaskError(f"{where}: context must be a string")
    if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
        raise TaskError(f"{where}: choices must be a list of at least two non-empty strings")
    if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < len(choices):
        raise TaskError(f"{where}: label {label!r} is out of range for {len(choices)} choices (give 0.."
                        f"{len(choices) - 1})")
    return Request(context, tuple(choices), label)


def read_task_file(path: str | Path, limit: int | None = None) -> Task:
    """The task in JSONL file ``path`` (its first ``limit`` requests), named by the file's stem."""
    path = Path(path)
    if not path.is_file():
        raise TaskError(f"--eval.tasks: task file {str(path)!r} not found; give an existing .jsonl file or a "
                        f"shipped task ({', '.join(SHIPPED)})")
    requests: list[Request] = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            requests.append(parse_request(line, f"task file {str(path)!r} line {number}"))
            if limit is not None and len(requests) == limit:
                break
    if not requests:
        raise TaskError(f"--eval.tasks: task file {str(path)!r} holds no requests")
    return Task(path.stem, tuple(requests))


def is_task_file(spec: str) -> bool:
    """Whether an ``[eval] tasks`` entry names a file (else a shipped task)."""
    return spec.endswith(".jsonl") or "/" in spec or "\\" in spec


def task_name(spec: str) -> str:
    return Path(spec).stem if is_task_file(spec) else spec


def _continuation(cfg: JobConfig, limit: int | None) -> Task:
    from torchtitan.downstream.continuation import build_continuation_task

    return build_continuation_task(cfg.validation, limit)


# Shipped tasks, by name: built from the project's own data, so they work offline.
SHIPPED: dict[str, Callable[[JobConfig, int | None], Task]] = {"continuation": _continuation}


def load_tasks(cfg: JobConfig) -> list[Task]:
    """Every task of ``[eval] tasks``, in order; ``TaskError`` at the first problem."""
    names = [task_name(spec) for spec in cfg.eval.tasks]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise TaskError(f"--eval.tasks: two tasks are named {duplicates[0]!r} (a task is named by its file's stem); "
                        "rename one file")
    tasks = []
    for spec in cfg.eval.tasks:
        if is_task_file(spec):
            tasks.append(read_task_file(spec, cfg.eval.limit))
        elif spec in SHIPPED:
            tasks.append(SHIPPED[spec](cfg, cfg.eval.limit))
            if not tasks[-1].requests:
                raise TaskError(f"--eval.tasks: the shipped task {spec!r} came out empty with this held-out split; "
                                "raise --validation.held_out_fraction")
        else:
            raise TaskError(f"--eval.tasks: unknown task {spec!r}; give a .jsonl file or a shipped task "
                            f"({', '.join(SHIPPED)})")
    return tasks
