"""A task's scores from the log-likelihood of each of its choices.

- ``acc``: the share of requests whose highest-likelihood choice is the right one;
- ``acc_norm``: the same with each log-likelihood divided by its choice's characters (a long
  choice is not penalised for its length);
- ``bpb``: the right choice's bits per UTF-8 byte, ``-LL / (bytes * ln 2)``, averaged over requests.

Ties go to the first choice (``argmax``). The log-likelihood of a choice is the sum of its
tokens' log-probabilities after the context (``encoding.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

SCORE_NAMES = ("acc", "acc_norm", "bpb")


def _argmax(values: Sequence[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))


def task_scores(loglik: Sequence[Sequence[float]], texts: Sequence[Sequence[str]],
                labels: Sequence[int]) -> dict[str, float]:
    """``{acc, acc_norm, bpb}`` of requests: ``loglik[r][c]`` of choice ``c`` (scored text ``texts[r][c]``) of
    request ``r``, whose right choice is ``labels[r]``."""
    n = len(labels)
    acc = acc_norm = bpb = 0.0
    for lls, choices, label in zip(loglik, texts, labels):
        acc += _argmax(lls) == label
        acc_norm += _argmax([ll / len(text) for ll, text in zip(lls, choices)]) == label
        bpb += -lls[label] / (len(choices[label].encode("utf-8")) * math.log(2))
    return {"acc": acc / n, "acc_norm": acc_norm / n, "bpb": bpb / n}
