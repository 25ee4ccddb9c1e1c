"""Multiple-choice tasks: how a JSONL task file is read, and how ``[eval] tasks`` names resolve.

A task file holds one request a line (``request.py`` reads a line). A task is named by
its file's stem (``arc_easy.jsonl`` is ``arc_easy``). A name without a path separator or a
``.jsonl`` ending is a shipped task (``SHIPPED``), built by the project from its own data.

Every problem with a file is a ``TaskError`` whose message is one line naming the file, the
line and the fix; preflight collects them on every rank before any process group exists.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from torchtitan.config.job_config import Eval, Validation
from torchtitan.downstream.continuation import build_continuation_task
from torchtitan.downstream.request import Request, Task, TaskError, parse_request


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


# Shipped tasks, by name: built from the project's own data (the documents the run's ``[validation]`` split holds
# out), so they work offline.
SHIPPED: dict[str, Callable[[Validation, int | None], Task]] = {"continuation": build_continuation_task}


def load_tasks(eval_cfg: Eval, validation: Validation) -> list[Task]:
    """Every task of ``[eval] tasks``, in order; ``TaskError`` at the first problem. ``validation``: the section
    whose held-out split the shipped tasks are built from."""
    names = [task_name(spec) for spec in eval_cfg.tasks]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise TaskError(f"--eval.tasks: two tasks are named {duplicates[0]!r} (a task is named by its file's stem); "
                        "rename one file")
    tasks = []
    for spec in eval_cfg.tasks:
        if is_task_file(spec):
            tasks.append(read_task_file(spec, eval_cfg.limit))
        elif spec in SHIPPED:
            tasks.append(SHIPPED[spec](validation, eval_cfg.limit))
            if not tasks[-1].requests:
                raise TaskError(f"--eval.tasks: the shipped task {spec!r} came out empty with this held-out split; "
                                "raise --validation.held_out_fraction")
        else:
            raise TaskError(f"--eval.tasks: unknown task {spec!r}; give a .jsonl file or a shipped task "
                            f"({', '.join(SHIPPED)})")
    return tasks
