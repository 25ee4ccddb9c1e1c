"""Every check of a job, in one place, run before any process group exists.

Each rank runs ``preflight(cfg, world_size)`` on its own. It reads only the config
and local files (tokenizer, data, checkpoints, initial weights), so a bad job fails
on every rank alike, with one line per problem that names the option and the fix,
and nobody waits in a collective. It raises ``ConfigError`` with every problem it
can find at once.

Who checks what:

- the config manager checks each field on its own while parsing: its type, its
  ``choices``, its ``min`` and finiteness, all declared in ``config/job_config.py``;
- this module checks everything else: values a type cannot express, options that
  depend on each other, the degrees against the world size and the model, the
  pipeline layout, the batch arithmetic, the checkpoint options;
- the readers of each file format (tokenizer, token store, checkpoint manifests,
  Hugging Face and Meta weights) say what is wrong with a file; this module asks them.

Functions elsewhere that guard their own arguments (``ParallelDims``,
``manual_seed``, ``validate_schedule``, ...) keep doing so for direct callers; a
config that passes preflight never trips them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import torch

from torchtitan.checkpoint.selection import checkpoint_folder, choose_checkpoint, model_shapes, own_checkpoint_exists
from torchtitan.checkpoint.store import STATE_KEYS, scan
from torchtitan.config import ConfigError, JobConfig
from torchtitan.datasets import DATASETS, Tokenizer, build_tokenizer, check_training_data
from torchtitan.distributed import MESH_DIM_NAMES, ParallelDims
from torchtitan.distributed.pipeline_parallel import (
    DEFAULT_STAGES_PER_RANK, SCHEDULE_CLASS_NAMES, SCHEDULES, SINGLE_STAGE_SCHEDULES, V_SHAPED_SCHEDULES,
    ZERO_BUBBLE_SCHEDULES, PipelinePlan, even_layer_starts,
)
from torchtitan.fault_tolerance.checks import check_fault_tolerance
from torchtitan.models import model_flavors
from torchtitan.models.llama3 import ModelArgs, Transformer
from torchtitan.models.llama3.model import ffn_hidden_dim
from torchtitan.optim.lr_scheduler import validate_schedule
from torchtitan.validate import check_validation_data, held_out_split

_PP = "--parallelism.pipeline_parallel_"


@dataclasses.dataclass
class Plan:
    """What preflight worked out from the config alone."""

    dims: ParallelDims
    grad_accum: int
    model_args: ModelArgs
    tokenizer: Tokenizer
    pipeline: PipelinePlan | None = None  # set when pipeline_parallel_degree > 1


def preflight(cfg: JobConfig, world_size: int) -> Plan:
    """Check the whole job without touching the network; raise ``ConfigError`` naming every problem."""
    problems = check_config(cfg)
    try:
        tokenizer = build_tokenizer(cfg.model.tokenizer_path)
    except (FileNotFoundError, ValueError) as e:
        problems.append(f"--model.tokenizer_path: {e}")
    try:
        dims = ParallelDims.from_config(cfg.parallelism, world_size)
    except ValueError as e:
        problems.append(str(e))
    _raise_if(problems)

    problems += check_fault_tolerance(cfg, dims)
    data_degree = data_parallel_degree(cfg, dims)
    grad_accum, found = gradient_accumulation_steps(cfg, data_degree)
    problems += found
    args = dataclasses.replace(
        model_flavors(cfg.model.name)[cfg.model.flavor], vocab_size=tokenizer.n_words, max_seq_len=cfg.training.seq_len
    )
    problems += check_parallelism(args, dims, cfg)
    pipeline = None
    if dims.pp_enabled:
        try:
            pipeline = plan_pipeline(cfg, args.n_layers)
        except ConfigError as e:
            problems += e.problems
    problems += check_checkpoint(cfg, world_size, lambda: Transformer(args), model_args=args)
    # Last, and only for an otherwise sound job: the data checks may prepare a token store.
    _raise_if(problems)
    problems += check_validation_data(cfg, tokenizer, dims.degree("dp"))
    t = cfg.training
    problems += check_training_data(dataset_name=t.dataset, dataset_path=t.dataset_path, tokenizer=tokenizer,
                                    split=held_out_split(cfg), seq_len=t.seq_len,
                                    global_batch=t.batch_size * data_degree)
    _raise_if(problems)
    return Plan(dims, grad_accum, args, tokenizer, pipeline)


def data_parallel_degree(cfg: JobConfig, dims: ParallelDims) -> int:
    """Ranks reading different data in the whole job: every replica group's under fault tolerance."""
    ft = cfg.fault_tolerance
    return dims.degree("dp") * (ft.num_replica_groups if ft.enable else 1)


def _raise_if(problems: list[str]) -> None:
    if problems:
        raise ConfigError(problems)


# ---- the config alone -------------------------------------------------------
def check_config(cfg: JobConfig) -> list[str]:
    """Problems visible in the config alone: values a type cannot express, and options that contradict."""
    problems: list[str] = []
    p, t = cfg.parallelism, cfg.training
    if p.data_parallel_shard_degree == 0 or p.data_parallel_shard_degree < -1:
        problems.append(f"--parallelism.data_parallel_shard_degree={p.data_parallel_shard_degree}: "
                        "use -1 (the ranks left over) or a degree >= 1")
    if t.global_batch_size == 0 or t.global_batch_size < -1:
        problems.append(f"--training.global_batch_size={t.global_batch_size}: use -1 (derived) or a positive size")
    if len(cfg.optimizer.betas) != 2 or not all(0.0 <= b < 1.0 for b in cfg.optimizer.betas):
        problems.append(f"--optimizer.betas={cfg.optimizer.betas}: give two values in [0, 1), e.g. 0.9,0.95")
    problems += _schedule_problems(cfg)
    unknown = [d for d in t.seed_sharded_dims if d not in MESH_DIM_NAMES]
    if unknown:
        problems.append(f"--training.seed_sharded_dims: unknown dim(s) {', '.join(unknown)}; "
                        f"choose from {', '.join(MESH_DIM_NAMES)}")
    if len(set(t.seed_sharded_dims)) != len(t.seed_sharded_dims):
        problems.append(f"--training.seed_sharded_dims={','.join(t.seed_sharded_dims)}: a dim is listed twice")
    flavors = model_flavors(cfg.model.name)
    if cfg.model.flavor not in flavors:
        problems.append(
            f"--model.flavor={cfg.model.flavor}: unknown for {cfg.model.name}; choose one of {', '.join(flavors)}"
        )
    ac = cfg.activation_checkpoint
    if ac.mode == "selective" and ac.selective_ac_option != "op" and not _positive_int(ac.selective_ac_option):
        problems.append(f"--activation_checkpoint.selective_ac_option={ac.selective_ac_option}: use 'op' (save "
                        "matmul outputs) or a positive integer N (checkpoint every N-th block)")
    if t.dataset_path is None and t.dataset not in DATASETS:
        problems.append(f"--training.dataset={t.dataset}: unknown; choose one of {', '.join(DATASETS)} "
                        "or give --training.dataset_path")
    if t.dataset_path is not None and not os.path.exists(os.path.expanduser(t.dataset_path)):
        problems.append(f"--training.dataset_path={t.dataset_path}: no such file or folder")
    return problems + _validation_problems(cfg)


def _positive_int(text: str) -> bool:
    return text.isdigit() and int(text) >= 1


def _schedule_problems(cfg: JobConfig) -> list[str]:
    s, steps = cfg.lr_scheduler, cfg.training.steps
    if s.lr_min > 1.0:
        return [f"--lr_scheduler.lr_min={s.lr_min}: it is a fraction of the peak lr (0..1)"]
    if s.decay_ratio is not None and s.decay_ratio > 1.0:
        return [f"--lr_scheduler.decay_ratio={s.decay_ratio}: it is a fraction (0..1)"]
    try:
        validate_schedule(warmup_steps=s.warmup_steps, decay_ratio=s.decay_ratio, decay_type=s.decay_type,
                          lr_min=s.lr_min, total_steps=steps)
    except ValueError as e:
        return [f"learning-rate schedule: {e} (--lr_scheduler.warmup_steps={s.warmup_steps}, "
                f"--lr_scheduler.decay_ratio={s.decay_ratio}, --training.steps={steps}); "
                "shorten the warmup/decay or train longer"]
    return []


def _validation_problems(cfg: JobConfig) -> list[str]:
    """The ``[validation]`` options; whether its data holds one batch is checked with the data."""
    v, problems = cfg.validation, []
    if v.held_out_fraction is not None and not 0.0 < v.held_out_fraction < 1.0:
        problems.append(f"--validation.held_out_fraction={v.held_out_fraction}: give a fraction strictly between 0 "
                        "and 1 (e.g. 0.01), or leave it unset to hold nothing out")
    if v.steps == 0 or v.steps < -1:
        problems.append(f"--validation.steps={v.steps}: give a number of batches >= 1, or -1 for the whole split")
    has_dataset = v.dataset is not None or v.dataset_path is not None
    if v.enable and not has_dataset and v.held_out_fraction is None:
        problems.append("--validation.enable needs data: set --validation.held_out_fraction (e.g. 0.01) to hold part "
                        "of the training data out, or --validation.dataset / --validation.dataset_path")
    if v.enable and v.dataset_path is None and v.dataset is not None and v.dataset not in DATASETS:
        problems.append(f"--validation.dataset={v.dataset}: unknown; choose one of {', '.join(DATASETS)} or give "
                        "--validation.dataset_path")
    if v.enable and v.dataset_path is not None and not os.path.exists(os.path.expanduser(v.dataset_path)):
        problems.append(f"--validation.dataset_path={v.dataset_path}: no such file or folder")
    return problems


# ---- the config against the world size and the model ------------------------
def gradient_accumulation_steps(cfg: JobConfig, dp_degree: int) -> tuple[int, list[str]]:
    """Micro-steps per optimizer step, from ``gradient_accumulation_steps`` or ``global_batch_size``, and problems."""
    t = cfg.training
    if t.global_batch_size == -1:
        return t.gradient_accumulation_steps, []
    found: list[str] = []
    per_micro_step = t.batch_size * dp_degree
    accum, rest = divmod(t.global_batch_size, per_micro_step)
    if rest or accum < 1:
        found.append(f"--training.global_batch_size={t.global_batch_size} is not a multiple of batch_size "
                     f"({t.batch_size}) x data-parallel degree ({dp_degree}) = {per_micro_step}; change one of them")
    elif t.gradient_accumulation_steps not in (1, accum):
        found.append(f"--training.gradient_accumulation_steps={t.gradient_accumulation_steps} contradicts "
                     f"global_batch_size={t.global_batch_size} (which implies {accum}); set only one of them")
    return max(accum, 1), found


def check_parallelism(args: ModelArgs, dims: ParallelDims, cfg: JobConfig) -> list[str]:
    """TP/CP problems that would otherwise show up as shape errors deep inside a collective."""
    problems: list[str] = []
    tp, cp = dims.tp, dims.cp
    seq_len, sequence_parallel = cfg.training.seq_len, cfg.parallelism.enable_sequence_parallel
    if tp > 1 and cfg.training.compile:
        # Seen on torch 2.13 (CPU): compiled TP blocks fail in backward inside DTensor's
        # redistribute ("'Tensor' object has no attribute '_local_tensor'"), and with AC
        # already in forward. Refused up front rather than after minutes of set-up.
        problems.append(f"--training.compile with tensor_parallel_degree={tp}: torch.compile of tensor-parallel "
                        "blocks fails in this PyTorch (DTensor backward); turn off compile for TP layouts "
                        "(compile was checked with FSDP, HSDP, DDP and CP)")
    if tp > 1:
        n_kv = args.n_kv_heads or args.n_heads
        for what, value in [("n_heads", args.n_heads), ("n_kv_heads", n_kv), ("dim", args.dim),
                            ("FFN hidden size", ffn_hidden_dim(args))]:
            if value % tp:
                problems.append(f"--parallelism.tensor_parallel_degree={tp}: the model's {what} ({value}) is not "
                                f"divisible by it; pick a degree that divides {what}")
        if args.vocab_size % tp:
            # Padding the vocabulary would change the parameter shapes (and checkpoints) with the layout.
            problems.append(f"--parallelism.tensor_parallel_degree={tp}: vocab size {args.vocab_size} is not divisible "
                            f"by it (the vocabulary is not padded); pick a degree that divides {args.vocab_size}")
    seq_shards = (2 * cp if cp > 1 else 1) * (tp if tp > 1 and sequence_parallel else 1)
    if seq_shards > 1 and seq_len % seq_shards:
        parts = []
        if cp > 1:
            parts.append(f"2 * context_parallel_degree ({2 * cp}, load-balanced chunks)")
        if tp > 1 and sequence_parallel:
            parts.append(f"tensor_parallel_degree ({tp}, sequence parallel)")
        fix = "change seq_len" + (" or set --parallelism.enable_sequence_parallel=false" if tp > 1 and sequence_parallel
                                  else "")
        problems.append(f"--training.seq_len={seq_len} must be divisible by {' x '.join(parts)} = {seq_shards}; {fix}")
    return problems


# ---- the pipeline -----------------------------------------------------------
def plan_pipeline(cfg: JobConfig, n_layers: int) -> PipelinePlan:
    """The pipeline's stages and microbatches; raise ``ConfigError`` listing every problem with them."""
    p = cfg.parallelism
    pp, problems = p.pipeline_parallel_degree, []
    schedule = {n.lower(): n for n in SCHEDULES}.get(p.pipeline_parallel_schedule.lower())
    if schedule is None:
        missing = [n for n in SCHEDULE_CLASS_NAMES if n not in SCHEDULES]
        note = f" ({', '.join(missing)} need a newer torch than {torch.__version__})" if missing else ""
        raise ConfigError([
            f"{_PP}schedule={p.pipeline_parallel_schedule}: unknown; choose one of {', '.join(SCHEDULES)}{note}"
        ])
    single = schedule in SINGLE_STAGE_SCHEDULES

    # How many stages, and which layers each one holds.
    v_flag = p.pipeline_parallel_stages_per_rank
    if p.pipeline_parallel_split_points:
        starts = _parse_split_points(p.pipeline_parallel_split_points, n_layers, problems)
        _raise_if(problems)
        num_stages = len(starts) - 1
        if num_stages % pp:
            raise ConfigError([
                f"{_PP}split_points: {len(starts) - 2} split points make {num_stages} stages, which do not divide "
                f"evenly over pipeline_parallel_degree={pp} ranks; give pp * stages_per_rank - 1 points"
            ])
        v = num_stages // pp
        if v_flag is not None and v_flag != v:
            problems.append(f"{_PP}stages_per_rank={v_flag} contradicts the split points, which make {v} stage(s) "
                            "per rank; leave stages_per_rank unset")
    else:
        v = v_flag if v_flag is not None else (1 if single else DEFAULT_STAGES_PER_RANK)
        num_stages = pp * v
        e, o = p.pipeline_parallel_embedding_weight, p.pipeline_parallel_output_weight
        if n_layers + e + o < num_stages:
            raise ConfigError([
                f"pipeline: {num_stages} stages ({pp} ranks x {v} per rank) but the model has only {n_layers} "
                f"layers{f' (+{e + o} for embedding/output weights)' if e or o else ''}; lower "
                f"pipeline_parallel_degree or stages_per_rank, or count the embedding/output as layers with "
                f"{_PP}embedding_weight / {_PP}output_weight"
            ])
        starts = even_layer_starts(n_layers, num_stages, e, o)
        empty = [s for s in range(1, num_stages - 1) if starts[s + 1] == starts[s]]
        if empty:
            problems.append(
                f"pipeline: an even split of {n_layers} layers over {num_stages} stages with embedding weight {e} and "
                f"output weight {o} leaves stage(s) {empty} without layers; lower the weights or give "
                f"{_PP}split_points"
            )
    if single and v != 1:
        problems.append(
            f"{_PP}schedule={schedule} runs one stage per rank, but the config asks for {v}; use one of "
            f"{', '.join(n for n in SCHEDULES if n not in SINGLE_STAGE_SCHEDULES)} for several stages per rank"
        )
    if not single and v < 2:
        problems.append(
            f"{_PP}schedule={schedule} is a multi-stage schedule and needs >= 2 stages per rank (got {v}); "
            f"use {' or '.join(SINGLE_STAGE_SCHEDULES)} for one stage per rank"
        )
    if schedule in V_SHAPED_SCHEDULES and v != 2:
        problems.append(f"{_PP}schedule={schedule} needs exactly 2 stages per rank (got {v})")

    # Microbatches.
    m = p.pipeline_parallel_microbatches or num_stages
    batch = cfg.training.batch_size
    if batch % m:
        problems.append(
            f"pipeline: local batch --training.batch_size={batch} is not divisible by {m} microbatches"
            f"{'' if p.pipeline_parallel_microbatches else ' (the default: one per stage)'}; set "
            f"{_PP}microbatches to a divisor of the batch size or change the batch size"
        )
    if schedule == "1F1B" and m < num_stages:
        problems.append(f"{_PP}schedule=1F1B needs at least as many microbatches as stages ({num_stages}); got {m}")
    if not single:
        rounds = max(1, m // pp)
        if m < pp:
            problems.append(f"{_PP}schedule={schedule} needs at least pipeline_parallel_degree={pp} microbatches; "
                            f"got {m}")
        elif schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and m % rounds:
            problems.append(
                f"{_PP}schedule={schedule}: {m} microbatches is not a multiple of the number of rounds "
                f"({rounds} = microbatches // pipeline_parallel_degree); use a multiple of {pp}"
            )
    if schedule in ZERO_BUBBLE_SCHEDULES and cfg.training.compile:
        problems.append(
            f"{_PP}schedule={schedule} splits backward into input and weight passes, which torch does not support "
            "on compiled blocks; turn off --training.compile or choose another schedule"
        )
    ac = cfg.activation_checkpoint
    if schedule in ZERO_BUBBLE_SCHEDULES and ac.mode == "selective" and ac.selective_ac_option == "op":
        problems.append(
            f"{_PP}schedule={schedule} runs backward through each block twice (input, then weight gradients), "
            "which op-level selective activation checkpointing forbids; use --activation_checkpoint.mode=full, "
            "selective with a block interval (selective_ac_option=N), or another schedule"
        )
    _raise_if(problems)
    return PipelinePlan(schedule=schedule, pp=pp, microbatches=m, layer_starts=starts)


def _parse_split_points(points: list[str], n_layers: int, problems: list[str]) -> tuple[int, ...]:
    indices = []
    for point in points:
        prefix, _, index = point.partition(".")
        if prefix != "layers" or not index.isdigit() or not 0 <= int(index) < n_layers:
            problems.append(f"{_PP}split_points: '{point}' is not a layer FQN of this model; "
                            f"use layers.N with 0 <= N < {n_layers}")
            return ()
        indices.append(int(index))
    if any(b <= a for a, b in zip(indices, indices[1:])):
        problems.append(f"{_PP}split_points={','.join(points)}: list the layers in increasing order, each once "
                        "(every stage between two split points needs at least one layer)")
        return ()
    return (0, *indices, n_layers)


# ---- checkpoints ------------------------------------------------------------
def check_checkpoint(cfg: JobConfig, world_size: int, model_factory: Callable[[], torch.nn.Module],
                     model_args: ModelArgs | None = None) -> list[str]:
    """One line per problem with the ``[checkpoint]`` options or the checkpoint they select.

    ``model_args`` (the configured ``ModelArgs``) lets ``initial_load_path`` be checked
    against the model; it is checked only when the run has no checkpoint of its own,
    since that one wins.
    """
    ck = cfg.checkpoint
    problems = _check_initial_load(cfg, model_args) if model_args is not None else []
    unknown = [k for k in ck.exclude_from_loading if k not in STATE_KEYS]
    if unknown:
        problems.append(f"--checkpoint.exclude_from_loading: unknown state(s) {', '.join(unknown)}; "
                        f"choose from {', '.join(STATE_KEYS)}")
    if ck.load_step < -1:
        problems.append(f"--checkpoint.load_step={ck.load_step}: use a step >= 0, or -1 for the latest checkpoint")
    if ck.create_seed_checkpoint:
        if world_size != 1:
            problems.append(f"--checkpoint.create_seed_checkpoint runs on one process, but WORLD_SIZE={world_size}; "
                            "run scripts/create_seed_checkpoint.sh (or python train.py without torchrun)")
        existing = scan(checkpoint_folder(cfg)).committed
        if existing:
            problems.append(f"--checkpoint.create_seed_checkpoint: {checkpoint_folder(cfg)} already holds checkpoints "
                            f"(steps {', '.join(map(str, sorted(existing)))}); a seed checkpoint goes into an empty "
                            "folder: choose another --checkpoint.folder or --job.dump_folder")
        return problems
    if ck.enable_checkpoint and not problems:
        listing = scan(checkpoint_folder(cfg))
        shapes = model_shapes(model_factory) if listing.committed else None
        problems += choose_checkpoint(cfg, shapes)[2]
    return problems


def _check_initial_load(cfg: JobConfig, model_args: ModelArgs) -> list[str]:
    ck = cfg.checkpoint
    if not ck.initial_load_path or ck.create_seed_checkpoint or own_checkpoint_exists(cfg):
        return []
    from torchtitan.checkpoint.formats import check_source  # reads safetensors/Meta files: imported when needed

    return check_source(ck.initial_load_path, ck.initial_load_format, model_args)
