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

import os
from collections.abc import Callable

import torch

from torchtitan.checkpoint import s3_client
from torchtitan.checkpoint.location import is_remote, store_problems, uri_problem
from torchtitan.checkpoint.selection import checkpoint_folder, choose_checkpoint, model_shapes, own_checkpoint_exists
from torchtitan.checkpoint.store import scan
from torchtitan.config import ConfigError, JobConfig
from torchtitan.datasets import DATASETS, HeldOutSplit, Tokenizer, build_tokenizer, check_training_data
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import is_per_op, selective_ac_interval
from torchtitan.distributed.parallel_dims import dp_shard_problem
from torchtitan.distributed.pipeline_plan import PipelinePlan
from torchtitan.distributed.seeding import sharded_dims_problem
from torchtitan.downstream.build import EvalOptions, check_eval_tasks
from torchtitan.evaluate import ValidationOptions, check_validation_data
from torchtitan.fault_tolerance.checks import check_fault_tolerance
from torchtitan.launch_plan import LaunchPlan, configured_model_args
from torchtitan.metrics.wandb_run import wandb_problems
from torchtitan.models import DecoderConfig, get_model_spec, model_args
from torchtitan.models.spec import ModelSpec
from torchtitan.optim.lr_scheduler import validate_schedule
from torchtitan.optim.muon_checks import muon_model_problems, muon_problems
from torchtitan.quantization import converter_problems
from torchtitan.quantization.converters import device_problems as converter_device_problems
from torchtitan.quantization.converters import model_problems as converter_model_problems
from torchtitan.stability.checks import stability_problems


def preflight(cfg: JobConfig, world_size: int, *, tokenizer: Tokenizer | None = None,
              check_data: bool = True) -> LaunchPlan:
    """Check the whole job without touching the network; raise ``ConfigError`` naming every problem.

    A planner (``torchtitan/planning``) passes a stand-in ``tokenizer`` and ``check_data=False``: a job
    is planned before its tokenizer and data are staged, and every other check runs as in a launch.
    """
    problems = check_config(cfg, check_data=check_data)
    if tokenizer is None:
        try:
            tokenizer = build_tokenizer(cfg.model.tokenizer_path)
        except (FileNotFoundError, ValueError) as e:
            problems.append(f"--model.tokenizer_path: {e}")
    try:
        dims = ParallelDims.from_config(cfg.parallelism, world_size)
    except ValueError as e:
        problems.append(str(e))
    _raise_if(problems)
    assert tokenizer is not None  # not building it was a problem, raised just above

    problems += check_fault_tolerance(cfg.fault_tolerance, dims, comm=cfg.comm, training=cfg.training,
                                      checkpoint=cfg.checkpoint, optimizer=cfg.optimizer)
    data_degree = data_parallel_degree(cfg, dims)
    grad_accum, found = gradient_accumulation_steps(cfg, data_degree)
    problems += found
    spec = get_model_spec(cfg.model.name)  # check_config checked the name
    args, found = configured_model_args(cfg, tokenizer)
    problems += found
    problems += check_parallelism(args, dims, cfg, spec)
    # --float8.filter_fqns against the model
    problems += converter_model_problems(cfg.model, cfg.float8, lambda: spec.build(args))
    # --optimizer.muon_adamw_fqns against the model's parameter names
    problems += muon_model_problems(cfg.optimizer, lambda: spec.build(args), f"{cfg.model.name} {cfg.model.flavor}")
    pipeline = None
    if dims.pp_enabled:
        try:
            pipeline = PipelinePlan.from_config(cfg.parallelism, cfg.training, cfg.activation_checkpoint,
                                                args.n_layers)
        except ConfigError as e:
            problems += e.problems
    problems += check_checkpoint(cfg, world_size, lambda: spec.build(args), model_args=args)
    # Last, and only for an otherwise sound job: the data checks may prepare a token store.
    _raise_if(problems)
    if not check_data:
        return LaunchPlan(dims, grad_accum, args, spec, tokenizer, pipeline)
    # The installed torch's known failures: a planner plans for the cluster's torch, so only a launch checks them.
    problems += check_installed_torch(cfg, dims)
    # FP8 on a GPU without FP8 tensor cores, or routed experts without the FP8 grouped GEMM
    problems += converter_device_problems(cfg.model, cfg.float8, lambda: spec.build(args))
    _raise_if(problems)
    problems += check_validation_data(ValidationOptions.of(cfg.validation, cfg.training, cfg.model), tokenizer,
                                      dims.degree("dp"))
    problems += check_eval_tasks(EvalOptions.of(cfg.eval, cfg.validation, cfg.training, cfg.model), tokenizer)
    t = cfg.training
    problems += check_training_data(dataset_name=t.dataset, dataset_path=t.dataset_path, tokenizer=tokenizer,
                                    split=HeldOutSplit.from_config(cfg.validation), seq_len=t.seq_len,
                                    global_batch=t.batch_size * data_degree,
                                    positions=args.attn_mask_type == "block_causal", mix=t.dataset_mix)
    _raise_if(problems)
    return LaunchPlan(dims, grad_accum, args, spec, tokenizer, pipeline)


def data_parallel_degree(cfg: JobConfig, dims: ParallelDims) -> int:
    """Ranks reading different data in the whole job: every replica group's under fault tolerance."""
    ft = cfg.fault_tolerance
    return dims.degree("dp") * (ft.num_replica_groups if ft.enable else 1)


def _raise_if(problems: list[str]) -> None:
    if problems:
        raise ConfigError(problems)


# ---- the config alone -------------------------------------------------------
def check_config(cfg: JobConfig, check_data: bool = True) -> list[str]:
    """Problems visible in the config alone: values a type cannot express, and options that contradict.

    ``check_data=False`` (a planner's dry run) skips whether the data set's files exist."""
    problems: list[str] = []
    p, t = cfg.parallelism, cfg.training
    problem = dp_shard_problem(p.data_parallel_shard_degree)
    if problem:
        problems.append(f"--parallelism.data_parallel_shard_degree={p.data_parallel_shard_degree}: {problem}")
    if t.global_batch_size == 0 or t.global_batch_size < -1:
        problems.append(f"--training.global_batch_size={t.global_batch_size}: use -1 (derived) or a positive size")
    if len(cfg.optimizer.betas) != 2 or not all(0.0 <= b < 1.0 for b in cfg.optimizer.betas):
        problems.append(f"--optimizer.betas={cfg.optimizer.betas}: give two values in [0, 1), e.g. 0.9,0.95")
    problems += _schedule_problems(cfg)
    problem = sharded_dims_problem(t.seed_sharded_dims)
    if problem:
        problems.append(f"--training.seed_sharded_dims={','.join(t.seed_sharded_dims)}: {problem}")
    try:
        model_args(cfg.model.name, cfg.model.flavor)
    except ValueError as e:
        problems.append(str(e))
    ac = cfg.activation_checkpoint
    if ac.mode == "selective":
        try:
            selective_ac_interval(ac.selective_ac_option)
        except ValueError as e:
            problems.append(f"--activation_checkpoint.{e}")
    if t.dataset_mix and t.dataset_path is not None:
        problems.append(f"--training.dataset_path={t.dataset_path} and --training.dataset_mix both name the training "
                        "data; give one (a single source is a mixture of one: weight 1)")
    if not t.dataset_mix and t.dataset_path is None and t.dataset not in DATASETS:
        problems.append(f"--training.dataset={t.dataset}: unknown; choose one of {', '.join(DATASETS)} "
                        "or give --training.dataset_path")
    if check_data and t.dataset_path is not None and not os.path.exists(os.path.expanduser(t.dataset_path)):
        problems.append(f"--training.dataset_path={t.dataset_path}: no such file or folder")
    problems += wandb_problems(cfg.metrics.enable_wandb)
    # torchao installed and in range, [float8] options that contradict
    problems += converter_problems(cfg.model, cfg.float8)
    problems += muon_problems(cfg)  # what Muon cannot do yet (step skipping)
    return problems + _validation_problems(cfg) + stability_problems(
        cfg.stability, checkpoint=cfg.checkpoint, ft=cfg.fault_tolerance, debug=cfg.debug)


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
    try:
        HeldOutSplit.from_config(v)
    except ValueError as e:
        problems.append(f"--validation.{e}")
    if v.steps == 0 or v.steps < -1:
        problems.append(f"--validation.steps={v.steps}: give a number of batches >= 1, or -1 for the whole split")
    has_dataset = v.dataset is not None or v.dataset_path is not None
    has_dataset = has_dataset or any(e.get("validation_path") for e in cfg.training.dataset_mix)  # per source
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


def check_parallelism(args: DecoderConfig, dims: ParallelDims, cfg: JobConfig, spec: ModelSpec) -> list[str]:
    """TP/CP problems that would otherwise show up as shape errors deep inside a collective; the model
    family's own (its widths against TP, ...) come from its spec."""
    problems: list[str] = []
    tp, cp = dims.tp, dims.cp
    seq_len, sequence_parallel = cfg.training.seq_len, cfg.parallelism.enable_sequence_parallel
    problems += spec.model.check(args, dims, cfg.model, cfg.parallelism)
    problems += _expert_problems(args, dims, cfg)
    # Where expert parallelism borrows TP's ranks, each MoE layer takes its TP rank's sequence shard, SP or not.
    seq_split = tp > 1 and (sequence_parallel or dims.ep_borrows_tp)
    seq_shards = (2 * cp if cp > 1 else 1) * (tp if seq_split else 1)
    if seq_shards > 1 and seq_len % seq_shards:
        parts = []
        if cp > 1:
            parts.append(f"2 * context_parallel_degree ({2 * cp}, load-balanced chunks)")
        if seq_split:
            why = "sequence parallel" if sequence_parallel else "expert parallelism borrows its ranks"
            parts.append(f"tensor_parallel_degree ({tp}, {why})")
        fix = "change seq_len" + (" or set --parallelism.enable_sequence_parallel=false"
                                  if seq_split and sequence_parallel and not dims.ep_borrows_tp else "")
        problems.append(f"--training.seq_len={seq_len} must be divisible by {' x '.join(parts)} = {seq_shards}; {fix}")
    return problems


def _expert_problems(args: DecoderConfig, dims: ParallelDims, cfg: JobConfig) -> list[str]:
    """Expert parallelism needs experts; the routing bias must see every replica group's tokens."""
    problems: list[str] = []
    model = f"--model.name={cfg.model.name} --model.flavor={cfg.model.flavor}"
    if dims.ep > 1 and not args.num_experts:
        problems.append(f"--parallelism.expert_parallel_degree={dims.ep}: {model} has no experts; set it to 1, or "
                        "choose a flavor with experts (qwen3 debugmodel_moe, 30B-A3B; mixtral 8x7B)")
    if args.num_experts and cfg.fault_tolerance.enable and (cfg.moe.load_balance_coeff or 0.0) > 0:
        problems.append(f"--moe.load_balance_coeff={cfg.moe.load_balance_coeff} with --fault_tolerance.enable: the "
                        "routing bias would be updated from each replica group's tokens alone and drift apart "
                        "between groups; set --moe.load_balance_coeff=0 (an auxiliary loss, --moe.aux_loss, works)")
    return problems


# ---- the installed torch ---------------------------------------------------------
def check_installed_torch(cfg: JobConfig, dims: ParallelDims) -> list[str]:
    """Layouts that this torch release is known to fail in (docs/versions.md), one line each."""
    ac = cfg.activation_checkpoint
    whole_blocks = ac.mode == "full" or (ac.mode == "selective" and not is_per_op(ac.selective_ac_option))
    release = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    if release == (2, 13) and dims.tp > 1 and cfg.training.compile and whole_blocks:
        # Compiled TP blocks recomputed whole (checkpoint without a policy) save the DeviceMesh for backward
        # as if it were a tensor: "expected all tensors_saved_with_vc_check to be Tensors". Fixed in 2.14.1.
        return [f"--training.compile with tensor_parallel_degree={dims.tp} and --activation_checkpoint.mode={ac.mode} "
                f"(whole blocks recomputed) fails in torch {torch.__version__}'s compiled forward; use torch >= "
                "2.14.1, or --activation_checkpoint.mode=selective --activation_checkpoint.selective_ac_option=op, "
                "or turn off compile (docs/versions.md, 'torch.compile and tensor parallelism')"]
    return []


# ---- checkpoints ------------------------------------------------------------
def check_checkpoint(cfg: JobConfig, world_size: int, model_factory: Callable[[], torch.nn.Module],
                     model_args: DecoderConfig | None = None) -> list[str]:
    """One line per problem with the ``[checkpoint]`` options or the checkpoint they select.

    ``model_args`` (the configured model family's args) lets ``initial_load_path`` be checked
    against the model; it is checked only when the run has no checkpoint of its own,
    since that one wins.
    """
    ck = cfg.checkpoint
    remote = _check_object_store(cfg)
    if remote:
        return remote  # the folder cannot be listed: nothing more to check there
    problems = _check_initial_load(cfg, model_args) if model_args is not None else []
    if ck.exclude_from_loading:
        problems += _unknown_states(ck.exclude_from_loading)
    if ck.load_step < -1:
        problems.append(f"--checkpoint.load_step={ck.load_step}: use a step >= 0, or -1 for the latest checkpoint")
    if ck.create_seed_checkpoint:
        if world_size != 1:
            problems.append(f"--checkpoint.create_seed_checkpoint runs on one process, but WORLD_SIZE={world_size}; "
                            "run scripts/create_seed_checkpoint.sh (or python train.py without torchrun)")
        folder = checkpoint_folder(ck, cfg.job.dump_folder)
        existing = scan(folder).committed
        if existing:
            problems.append(f"--checkpoint.create_seed_checkpoint: {folder} already holds checkpoints "
                            f"(steps {', '.join(map(str, sorted(existing)))}); a seed checkpoint goes into an empty "
                            "folder: choose another --checkpoint.folder or --job.dump_folder")
        return problems
    if ck.enable_checkpoint and not problems:
        folder = checkpoint_folder(ck, cfg.job.dump_folder)
        listing = scan(folder)  # listed once: choose_checkpoint reads this listing
        shapes = model_shapes(model_factory) if listing.committed else None
        problems += choose_checkpoint(ck, folder, listing, shapes)[2]
    return problems


def _unknown_states(names: list[str]) -> list[str]:
    """``--checkpoint.exclude_from_loading`` names a state no checkpoint holds: one line, with the choices."""
    from torchtitan.checkpoint.states import STATE_KEYS  # torch's DCP: imported only when states are named

    unknown = [k for k in names if k not in STATE_KEYS]
    if not unknown:
        return []
    return [f"--checkpoint.exclude_from_loading: unknown state(s) {', '.join(unknown)}; "
            f"choose from {', '.join(STATE_KEYS)}"]


def _check_object_store(cfg: JobConfig) -> list[str]:
    """Object-store URIs in ``checkpoint.folder`` / ``initial_load_path``: well formed, their driver, the bucket
    (reached with the job's S3 timeouts, which this process keeps), and what cannot use them."""
    ck = cfg.checkpoint
    s3_client.configure(s3_client.S3Timeouts.from_config(ck))
    problems = []
    for flag, uri in (("--checkpoint.folder", ck.folder), ("--checkpoint.initial_load_path", ck.initial_load_path)):
        problem = uri_problem(uri) if uri else None
        if problem:
            problems.append(f"{flag}={uri}: {problem}")
        elif uri and is_remote(uri):
            problems += [f"{flag}={uri}: {line}" for line in store_problems(uri)]
    if is_remote(ck.folder) and ck.enable_checkpoint and cfg.fault_tolerance.enable:
        problems.append(f"--checkpoint.folder={ck.folder}: fault-tolerant replica groups each commit a folder of "
                        "their own by a rename, which an object store lacks; with --fault_tolerance.enable use a "
                        "shared file system path")
    return problems


def _check_initial_load(cfg: JobConfig, model_args: DecoderConfig) -> list[str]:
    ck = cfg.checkpoint
    if not ck.initial_load_path or ck.create_seed_checkpoint or own_checkpoint_exists(ck, cfg.job.dump_folder):
        return []
    from torchtitan.checkpoint.formats import check_source  # reads safetensors/Meta files: imported when needed

    return check_source(ck.initial_load_path, ck.initial_load_format, model_args)
