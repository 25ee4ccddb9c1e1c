"""Downstream evaluation during training: multiple-choice tasks scored through training's forward, in every layout.

Each task's rows (one per request and choice, ``encoding.py``) are dealt out like validation
windows: in global batches of ``batch_size x dp degree`` rows, rank ``d`` of the data-parallel
mesh taking the ``d``-th slice; the last batch is filled with padding rows, which score nothing,
so every rank runs the same number of forwards (FSDP and PP need their peers at each). A batch
goes through the runner's validation forward (CP sequence shards, loss parallel under TP, PP's
forward-only pass) with a loss that sums each row on its own (``loss.cross_entropy_rows``).

Every rank writes the sums it holds into a vector indexed by the row's place in the task; the
vector is summed over the pipeline stages (only the last holds sums) and then over ``dp x cp``
(each data-parallel rank holds its own rows, each CP rank its share of a row's tokens). So
every rank ends with every row's full log-likelihood whatever the layout, and computes the same
scores (``scores.py``). Nothing training uses is touched (``evaluate.evaluation_mode``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator

import torch
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.batch import Batch
from torchtitan.datasets.layout import DataLayout
from torchtitan.datasets.tokenizer import Tokenizer
from torchtitan.distributed.collectives import start_sum
from torchtitan.downstream.encoding import ScoredChoice, request_rows, row_tensors
from torchtitan.downstream.request import Task
from torchtitan.downstream.scores import task_scores
from torchtitan.evaluate import evaluation_mode

# A batch -> each row's summed cross-entropy (None on a PP rank without the last stage).
RowForward = Callable[[Batch], torch.Tensor | None]


@dataclasses.dataclass(frozen=True)
class EncodedTask:
    """A task as rows: ``rows[i]`` is choice ``choice_of[i][1]`` of request ``choice_of[i][0]``."""

    name: str
    rows: tuple[ScoredChoice, ...]
    choice_of: tuple[tuple[int, int], ...]
    labels: tuple[int, ...]
    n_choices: tuple[int, ...]

    @classmethod
    def of(cls, task: Task, tokenizer: Tokenizer) -> EncodedTask:
        rows, choice_of = [], []
        for r, request in enumerate(task.requests):
            for c, row in enumerate(request_rows(tokenizer, request)):
                rows.append(row)
                choice_of.append((r, c))
        return cls(task.name, tuple(rows), tuple(choice_of), tuple(q.label for q in task.requests),
                   tuple(len(q.choices) for q in task.requests))

    def scores(self, row_nll: list[float]) -> dict[str, float]:
        """``{acc, acc_norm, bpb}`` from each row's negative log-likelihood."""
        loglik: list[list[float]] = [[0.0] * n for n in self.n_choices]
        texts: list[list[str]] = [[""] * n for n in self.n_choices]
        for (r, c), row, nll in zip(self.choice_of, self.rows, row_nll):
            loglik[r][c], texts[r][c] = -nll, row.text
        return task_scores(loglik, texts, self.labels)


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """How rows become batches on this rank: ``data``'s local batch of rows per forward, its slice of each global
    batch and its sequence length (the data layer's ``DataLayout``); the token ids rows are padded with; positions
    for document-masked models."""

    data: DataLayout
    bos_id: int
    pad_id: int
    positions: bool

    def batches(self, task: EncodedTask) -> Iterator[tuple[list[int], Batch]]:
        """This rank's batches, each with the task row index of every batch row (-1: padding)."""
        data, per_global = self.data, self.data.global_batch_size
        for b in range(math.ceil(len(task.rows) / per_global)):
            first = b * per_global + data.first_row
            ids = [i if i < len(task.rows) else -1 for i in range(first, first + data.local_batch_size)]
            pairs = [row_tensors(task.rows[i] if i >= 0 else None, self.bos_id, self.pad_id, data.seq_len)
                     for i in ids]
            inputs, labels = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
            positions = torch.arange(data.seq_len).expand_as(inputs).clone() if self.positions else None
            yield ids, Batch(inputs, labels, positions)


class DownstreamEvaluator:
    """Scores ``tasks`` through ``row_forward`` every ``freq`` steps and at the last step."""

    def __init__(self, tasks: list[EncodedTask], layout: RowLayout, model_parts: list[torch.nn.Module],
                 row_forward: RowForward, loss_mesh: DeviceMesh | None, pp_mesh: DeviceMesh | None,
                 device: torch.device, freq: int, last_step: int):
        self.tasks, self.layout, self.model_parts, self.row_forward = tasks, layout, model_parts, row_forward
        self.loss_mesh, self.pp_mesh, self.device = loss_mesh, pp_mesh, device
        self.freq, self.last_step = freq, last_step

    def due(self, step: int) -> bool:
        return step % self.freq == 0 or step == self.last_step

    @torch.no_grad()
    def run(self) -> dict[str, float]:
        """``eval/<task>/{acc,acc_norm,bpb}`` of every task, the same on every rank."""
        with evaluation_mode(self.model_parts, self.device):
            local = {task.name: self._row_sums(task) for task in self.tasks}
        metrics = {}
        for task in self.tasks:
            sums = start_sum(local[task.name], self.pp_mesh)()  # only the last stage holds the sums
            sums = start_sum(sums, self.loss_mesh)()
            for name, value in task.scores(sums.cpu().tolist()).items():
                metrics[f"eval/{task.name}/{name}"] = value
        return metrics

    def _row_sums(self, task: EncodedTask) -> torch.Tensor:
        """The summed cross-entropy of every row this rank scored, at the row's index (0 elsewhere)."""
        sums = torch.zeros(len(task.rows), dtype=torch.float64, device=self.device)
        for ids, batch in self.layout.batches(task):
            row_sums = self.row_forward(batch)
            if row_sums is None:
                continue
            keep = [j for j, i in enumerate(ids) if i >= 0]
            if keep:
                index = torch.tensor([ids[j] for j in keep], device=self.device)
                sums.index_add_(0, index, row_sums[keep].to(self.device))
        return sums
