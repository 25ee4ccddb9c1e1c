"""What a job's config makes before anything runs: the model arguments it asks for and the launch plan.

``configured_model_args`` turns ``--model.*`` and the tokenizer into the family's arguments (the trainer,
the planner, generation and the export script build the same model from it); ``LaunchPlan`` is what
``preflight`` (``torchtitan/preflight.py``, which only checks) hands the trainer and the planner once
the job is sound.
"""

from __future__ import annotations

import dataclasses

from torchtitan.config import JobConfig
from torchtitan.datasets import Tokenizer
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.pipeline_plan import PipelinePlan
from torchtitan.models import DecoderConfig, get_model_spec, model_args, model_flavors
from torchtitan.models.spec import ModelSpec


@dataclasses.dataclass
class LaunchPlan:
    """What preflight worked out from the config alone."""

    dims: ParallelDims
    grad_accum: int
    model_args: DecoderConfig  # the family's args
    model_spec: ModelSpec[DecoderConfig]  # the family (--model.name)
    tokenizer: Tokenizer
    pipeline: PipelinePlan | None = None  # set when pipeline_parallel_degree > 1


def configured_model_args(cfg: JobConfig, tokenizer: Tokenizer) -> tuple[DecoderConfig, list[str]]:
    """The model to build, and problems with it. A named flavor takes the tokenizer's vocabulary; a
    release keeps its own, which must hold every token id of the tokenizer."""
    args = dataclasses.replace(model_args(cfg.model.name, cfg.model.flavor), attn_mask_type=cfg.model.attn_mask_type)
    problems: list[str] = []
    if cfg.model.flavor not in model_flavors(cfg.model.name):  # a release: model_args read it
        if tokenizer.n_words > args.vocab_size:
            problems.append(f"--model.tokenizer_path={cfg.model.tokenizer_path}: {tokenizer.n_words} tokens, more than "
                            f"the vocabulary of --model.flavor={cfg.model.flavor} ({args.vocab_size}); use the "
                            "release's own tokenizer")
        args = dataclasses.replace(args, max_seq_len=cfg.training.seq_len)
    else:
        args = dataclasses.replace(args, vocab_size=tokenizer.n_words, max_seq_len=cfg.training.seq_len)
    if cfg.model.mtp_layers and not args.has_mtp:
        problems.append(f"--model.mtp_layers={cfg.model.mtp_layers}: model family {cfg.model.name} has no "
                        "multi-token prediction; use --model.name=deepseek_v3 or --model.mtp_layers=0")
    spec = get_model_spec(cfg.model.name)
    if cfg.moe.load_balance_coeff is None:  # unset: the family's default, filled here for every later reader
        cfg.moe.load_balance_coeff = spec.model.default_load_balance_coeff()
    return spec.model.with_job_options(args, cfg.model, cfg.moe), problems
