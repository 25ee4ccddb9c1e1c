"""DeepSeek-V3's preflight checks and job options; its TP plan is the decoder's, MLA giving its own part
(``mla.py``: heads sharded, the latent path whole), and CP, PP and EP are the decoder's."""

from __future__ import annotations

import dataclasses

from torchtitan.config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.common import parallel
from torchtitan.models.common.decoder_spec import DECODER_EXPERTS
from torchtitan.models.deepseek_v3.args import DeepSeekV3Args


def check(args: DeepSeekV3Args, dims: ParallelDims, cfg: JobConfig) -> list[str]:
    """The decoder's problems (widths TP must divide, experts EP must divide, the attention backend), and the
    layouts multi-token prediction cannot run in yet, one line each."""
    problems = parallel.check(args, dims, cfg)
    if args.num_mtp_layers:
        # Its modules read the token ids and the shared embedding beside the last block's output (one stage
        # has not both), roll the tokens along the whole sequence (a CP rank holds chunks of it), and are
        # not in the TP plan's tested layouts yet.
        for flag, degree in (("pipeline_parallel_degree", cfg.parallelism.pipeline_parallel_degree),
                             ("context_parallel_degree", dims.cp), ("tensor_parallel_degree", dims.tp)):
            if degree > 1:
                problems.append(f"--model.mtp_layers={args.num_mtp_layers} with --parallelism.{flag}={degree}: no "
                                f"schedule places the multi-token prediction modules there yet; use "
                                f"--parallelism.{flag}=1 or --model.mtp_layers=0")
    return problems


def with_job_options(args: DeepSeekV3Args, cfg: JobConfig) -> DeepSeekV3Args:
    """The job's [moe] balancing (the decoder's) and its multi-token prediction options."""
    args = DECODER_EXPERTS.with_moe_options(args, cfg)  # type: ignore[assignment]  # the same dataclass back
    return dataclasses.replace(args, num_mtp_layers=cfg.model.mtp_layers, mtp_loss_weight=cfg.model.mtp_loss_weight)
