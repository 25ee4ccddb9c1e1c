"""The ``[eval]`` section made real: its preflight check, and the evaluator a trainer runs."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from torchtitan.batch import Batch
from torchtitan.config.job_config import Eval, Model, Training, Validation
from torchtitan.datasets.layout import DataLayout
from torchtitan.datasets.tokenizer import Tokenizer
from torchtitan.distributed import ParallelDims
from torchtitan.downstream.encoding import check_lengths
from torchtitan.downstream.evaluator import DownstreamEvaluator, EncodedTask, RowLayout
from torchtitan.downstream.request import TaskError
from torchtitan.downstream.tasks import load_tasks
from torchtitan.loss import cross_entropy_rows

if TYPE_CHECKING:  # the preflight imports this module; the runner (torch's pipelining) only the trainer needs
    from torchtitan.train_step.runner import ModelRunner


@dataclasses.dataclass(frozen=True)
class EvalOptions:
    """What the downstream evaluation reads of a job: ``[eval]``, the ``[validation]`` split the shipped tasks come
    from, and the ``[training]`` and ``[model]`` values it shares with training; built once (``of``) by the
    preflight and by the trainer."""

    eval_cfg: Eval  # the [eval] section: the tasks, their limit, batch size and frequency
    validation: Validation
    training: Training  # its data (whether the shipped text is trained on), seq_len, local batch and last step
    positions: bool  # block_causal masks: the rows carry positions, as training's batches do

    @classmethod
    def of(cls, eval_cfg: Eval, validation: Validation, training: Training, model: Model) -> EvalOptions:
        return cls(eval_cfg, validation, training, positions=model.attn_mask_type == "block_causal")

    @property
    def batch_size(self) -> int:
        """The local batch of rows: ``[eval] batch_size``, else training's."""
        return self.eval_cfg.batch_size or self.training.batch_size

    @property
    def trains_on_shipped_text(self) -> bool:
        """Training reads the embedded corpus whole, so the shipped task's passages would be trained on."""
        t = self.training
        return (t.dataset == "embedded" and t.dataset_path is None and not t.dataset_mix
                and self.validation.held_out_fraction is None)


def encoded_tasks(options: EvalOptions, tokenizer: Tokenizer) -> list[EncodedTask]:
    """Every task of ``[eval] tasks`` as rows; ``TaskError`` naming the first problem."""
    if "continuation" in options.eval_cfg.tasks and options.trains_on_shipped_text:
        raise TaskError("--eval.tasks=continuation: training reads the whole embedded corpus, which the task's "
                        "passages come from; set --validation.held_out_fraction (e.g. 0.05) so that training "
                        "leaves them out")
    encoded = [EncodedTask.of(task, tokenizer) for task in load_tasks(options.eval_cfg, options.validation)]
    for task in encoded:
        check_lengths(task.name, task.rows, task.choice_of, options.training.seq_len)
    return encoded


def check_eval_tasks(options: EvalOptions, tokenizer: Tokenizer) -> list[str]:
    """Problems with ``[eval] tasks`` (empty when fine): missing or malformed files, unknown names."""
    if not options.eval_cfg.tasks:
        return []
    try:
        encoded_tasks(options, tokenizer)
    except TaskError as e:
        return [str(e)]
    except OSError as e:  # an unreadable file, or the embedded corpus that cannot be written
        return [f"--eval.tasks: {e}"]
    return []


def build_downstream_evaluator(options: EvalOptions, tokenizer: Tokenizer, runner: ModelRunner, dims: ParallelDims,
                               device: torch.device) -> DownstreamEvaluator | None:
    """The evaluator of ``[eval]`` (None without tasks), over this rank's share of the rows."""
    if not options.eval_cfg.tasks:
        return None
    dp_rank, dp_degree = dims.rank_and_size("dp")
    rows = DataLayout(seq_len=options.training.seq_len, local_batch_size=options.batch_size, dp_rank=dp_rank,
                      dp_degree=dp_degree)
    layout = RowLayout(rows, bos_id=tokenizer.bos_id, pad_id=tokenizer.eos_id, positions=options.positions)

    def row_forward(batch: Batch) -> torch.Tensor | None:
        return runner.validation_forward(batch, cross_entropy_rows)[0]

    return DownstreamEvaluator(encoded_tasks(options, tokenizer), layout, runner.model_parts, row_forward,
                               dims.get_mesh("dp_cp"), dims.get_mesh("pp"), device, options.eval_cfg.freq,
                               options.training.steps)

