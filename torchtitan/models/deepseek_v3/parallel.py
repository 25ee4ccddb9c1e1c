"""DeepSeek-V3's preflight checks beyond the decoder's: the layouts multi-token prediction cannot run in
(``DeepSeekV3Model.check``). Its TP plan, pipeline split and job options are the model class's overrides
(``model.py``); CP and EP are the decoder's."""

from __future__ import annotations

from torchtitan.config import job_config
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.pipeline_plan import V_SHAPED_SCHEDULES


def mtp_problems(depths: int, dims: ParallelDims, parallelism: job_config.Parallelism) -> list[str]:
    """Where ``depths`` MTP modules cannot run: a CP rank holds chunks of the sequence that the depths roll along,
    and a V-shaped schedule puts the first and the last stage (which both hold the embedding they share) on one
    rank."""
    problems, flag = [], f"--model.mtp_layers={depths}"
    if dims.cp > 1:
        problems.append(f"{flag} with --parallelism.context_parallel_degree={dims.cp}: no schedule places the "
                        "multi-token prediction modules there yet (each depth reads the tokens further along the "
                        "sequence, which another CP rank holds); use --parallelism.context_parallel_degree=1 or "
                        "--model.mtp_layers=0")
    schedule = parallelism.pipeline_parallel_schedule
    if parallelism.pipeline_parallel_degree > 1 and schedule.lower() in (s.lower() for s in V_SHAPED_SCHEDULES):
        problems.append(f"{flag} with --parallelism.pipeline_parallel_schedule={schedule}: the V-shaped schedule "
                        "puts the first and the last stage, which both hold the embedding the MTP modules share, "
                        "on one rank; use a looped schedule (1F1B, Interleaved1F1B, ...) or --model.mtp_layers=0")
    return problems
