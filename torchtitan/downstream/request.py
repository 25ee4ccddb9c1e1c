"""What a multiple-choice request is, and how one JSONL line of a task file becomes one.

A task file holds one request a line, ``{"context": str, "choices": [str, ...], "label": int}``: the
context, the candidate continuations, and the index of the right one. Every problem is a ``TaskError``
whose message is one line naming the file, the line and the fix. The task files and the shipped tasks
that build ``Task``s are ``tasks.py`` and ``continuation.py``.
"""

from __future__ import annotations

import dataclasses
import json


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
    _check_label(label, len(choices), where)
    return Request(context, tuple(choices), label)


def _check_label(label: object, n_choices: int, where: str) -> None:
    """The label is the right choice's index. A boolean is refused rather than read as 1/0: whether ``true``
    is choice 1 depends on the order the export wrote the choices in (``["yes", "no"]`` makes it 0), and a
    wrong guess inverts every score without a word."""
    allowed = f"give the index of the right choice, an integer 0..{n_choices - 1}"
    if isinstance(label, bool):
        raise TaskError(f"{where}: label {json.dumps(label)} is a boolean, not a choice's index; {allowed} (for a "
                        "true/false dataset, the index of the choice that means true or false)")
    if not isinstance(label, int):
        raise TaskError(f"{where}: label {json.dumps(label)} is not an integer; {allowed}")
    if not 0 <= label < n_choices:
        raise TaskError(f"{where}: label {label} is out of range for {n_choices} choices; {allowed}")
