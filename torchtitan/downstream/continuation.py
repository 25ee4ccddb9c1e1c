"""The shipped task ``continuation``: which of four passages continues this one.

Built from the embedded corpus (``datasets/embedded_corpus.py``, the project's own offline
text), from the documents the held-out split keeps back: the run's split
(``validation.held_out_fraction`` / ``split_seed``) when it sets one, else ``DEFAULT_SPLIT``.
So a run that trains on the embedded corpus with a held-out fraction never trains on a
passage of the task (preflight refuses the embedded corpus without one, see ``checks.py``).

Each held-out document, its whitespace collapsed, is cut into consecutive windows: a
context of about ``CONTEXT_CHARS`` characters and the next ``CHOICE_CHARS`` or so, both cut
at a space, so every choice begins with one; windows with other characters than ASCII are left
out (the shipped tokenizer spells them a byte a token, too long for a short ``seq_len``). The
wrong choices are the continuations of three windows of other documents, drawn with a fixed
seed, and the right one's place is drawn too: the task is the same on every machine with the
same Python (the corpus depends on the Python version, see ``embedded_corpus.py``). With the
default split it has 309 requests under Python 3.11.
"""

from __future__ import annotations

import json
import random

from torchtitan.config.job_config import Validation
from torchtitan.datasets.embedded_corpus import ensure_embedded_corpus
from torchtitan.datasets.split import HeldOutSplit
from torchtitan.downstream.request import Request, Task

DEFAULT_SPLIT = HeldOutSplit(fraction=0.05, seed=0)
CONTEXT_CHARS = 160
CHOICE_CHARS = 48
N_CHOICES = 4
_SEED = 0
_MIN_POOL = 16


def held_out_documents(validation: Validation) -> list[str]:
    """The embedded corpus's documents that the run's split (else ``DEFAULT_SPLIT``) holds out, whitespace collapsed."""
    split = HeldOutSplit.from_config(validation) or DEFAULT_SPLIT
    with open(ensure_embedded_corpus(), encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    return [" ".join(text.split()) for text in texts if split.held_out(text)]


def _cut(text: str, start: int, length: int) -> int | None:
    """The first space at or after ``start + length`` (None when the text ends first)."""
    end = text.find(" ", start + length)
    return None if end < 0 else end


def passages(document: str) -> list[tuple[str, str]]:
    """``(context, continuation)`` windows of one document; each continuation starts with a space."""
    out, start = [], 0
    while True:
        middle = _cut(document, start, CONTEXT_CHARS)
        end = None if middle is None else _cut(document, middle + 1, CHOICE_CHARS)
        if middle is None or end is None:
            return out
        if document[start:end].isascii():  # other scripts fall back to a token a byte: too long for small models
            out.append((document[start:middle], document[middle:end]))
        start = end + 1


def build_continuation_task(validation: Validation, limit: int | None = None) -> Task:
    """The ``continuation`` task: ``limit`` requests (all when None).

    The windows are shuffled before ``limit`` keeps the first ones, and the wrong choices are drawn
    from the kept windows only (from the first ``_MIN_POOL`` when fewer are kept): every kept passage
    is a right choice once and a wrong one about three times, so a score that ignores the context
    (one that prefers a style of passage) stays at chance.
    """
    windows = [(doc_id, context, choice) for doc_id, document in enumerate(held_out_documents(validation))
               for context, choice in passages(document)]
    rng = random.Random(_SEED)
    rng.shuffle(windows)
    kept = windows[:limit] if limit is not None else windows
    pool = windows[:max(len(kept), _MIN_POOL)]  # a few requests still draw from several documents
    requests = []
    for doc_id, context, gold in kept:
        others = [choice for other, _, choice in pool if other != doc_id]
        if len(others) < N_CHOICES - 1:
            continue
        choices = rng.sample(others, N_CHOICES - 1)
        label = rng.randrange(N_CHOICES)
        choices.insert(label, gold)
        requests.append(Request(context, tuple(choices), label))
    return Task("continuation", tuple(requests))
