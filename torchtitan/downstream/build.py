"""The ``[eval]`` section made real: its preflight check, and the evaluator a trainer runs."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from torchtitan.batch import Batch
from torchtitan.config.job_config import JobConfig
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


def eval_batch_size(cfg: JobConfig) -> int:
    return cfg.eval.batch_size or cfg.training.batch_size


def _trains_on_shipped_text(cfg: JobConfig) -> bool:
    """Training reads the embedded corpus whole, so the shipped task's passages would be trained on."""
    t = cfg.training
    return (t.dataset == "embedded" and t.dataset_path is None and not t.dataset_mix
            and cfg.validation.held_out_fraction is None)


def encoded_tasks(cfg: JobConfig, tokenizer: Tokenizer) -> list[EncodedTask]:
    """Every task of ``[eval] tasks`` as rows; ``TaskError`` naming the first problem."""
    if "continuation" in cfg.eval.tasks and _trains_on_shipped_text(cfg):
        raise TaskError("--eval.tasks=continuation: training reads the whole embedded corpus, which the task's "
                        "passages come from; set --validation.held_out_fraction (e.g. 0.05) so that training "
                        "leaves them out")
    encoded = [EncodedTask.of(task, tokenizer) for task in load_tasks(cfg)]
    for task in encoded:
        check_lengths(task.name, task.rows, task.choice_of, cfg.training.seq_len)
    return encoded


def check_eval_tasks(cfg: JobConfig, tokenizer: Tokenizer) -> list[str]:
    """Problems with ``[eval] tasks`` (empty when fine): missing or malformed files, unknown names."""
    if not cfg.eval.tasks:
        return []
    try:
        encoded_tasks(cfg, tokenizer)
    except TaskError as e:
        return [str(e)]
    except OSError as e:  # an unreadable file, or the embedded corpus that cannot be written
        return [f"--eval.tasks: {e}"]
    return []


def build_downstream_evaluator(cfg: JobConfig, tokenizer: Tokenizer, runner: ModelRunner, dims: ParallelDims,
                               device: torch.device) -> DownstreamEvaluator | None:
    """The evaluator of ``[eval]`` (None without tasks), over this rank's share of the rows."""
    if not cfg.eval.tasks:
        return None
    dp_rank, dp_degree = dims.rank_and_size("dp")
    rows = DataLayout(seq_len=cfg.training.seq_len, local_batch_size=eval_batch_size(cfg), dp_rank=dp_rank,
                      dp_degree=dp_degree)
    layout = RowLayout(rows, bos_id=tokenizer.bos_id, pad_id=tokenizer.eos_id,
                       positions=cfg.model.attn_mask_type == "block_causal")

    def row_forward(batch: Batch) -> torch.Tensor | None:
        return runner.validation_forward(batch, cross_entropy_rows)[0]

    return DownstreamEvaluator(encoded_tasks(cfg, tokenizer), layout, runner.model_parts, row_forward,
                               dims.get_mesh("dp_cp"), dims.get_mesh("pp"), device, cfg.eval.freq,
                               cfg.training.steps)

