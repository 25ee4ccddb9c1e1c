"""The job configuration: one dataclass per TOML section.

Every field is made by ``field_with_help``: a default and a one-line help text
(``metadata["help"]``), which ``--help`` prints. Optional checks live in the metadata too:
``choices`` for enumerations and ``min`` for lower bounds; the config manager enforces them.
``JobConfig`` gathers the sections; ``config/manager.py`` fills it from the TOML file and
the command line, and ``preflight.py`` checks it before any process group exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from torchtitan.config.dataset_mix import CLI_FORM, parse_mix_entry


def field_with_help(default: Any, help: str, *, choices: tuple | None = None,
                    min: float | None = None, parse: Any = None) -> Any:
    """A dataclass field with a default, a help line and optional checks (``parse``: how a ``list[dict]``
    field reads one item, ``(value, from_cli) -> dict``)."""
    meta = {"help": help, "choices": choices, "min": min, "parse": parse}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class Job:
    config_file: str | None = field_with_help(None, "TOML file to read; CLI flags override its values")
    dump_folder: str = field_with_help("./outputs", "Folder for logs, the effective config, checkpoints and traces")
    description: str = field_with_help("default job", "Free-text description of the job, printed at start")
    print_args: bool = field_with_help(True, "Print the effective config on rank 0 at start")


@dataclass
class Model:
    # The families are those the model registry knows (torchtitan/models/registry.py); preflight checks the name.
    # ``--help`` prints the registry's own lines for these two (``registry.config_help``).
    name: str = field_with_help("llama3", "Model family, as the model registry names it")
    flavor: str = field_with_help("debugmodel", "Model size within the family, or a release to read the shape from")
    tokenizer_path: str = field_with_help(
        "torchtitan/datasets/assets/tokenizer.model",
        "Tokenizer: SentencePiece or Llama 3 tiktoken tokenizer.model, or a Hugging Face tokenizer.json (file or "
        "folder); the format is read from the content. Relative paths also resolve against the repository root",
    )
    attn_mask_type: str = field_with_help(
        "block_causal", "Attention mask: block_causal (a token attends only to earlier tokens of its own document, "
        "RoPE restarts per document; as Llama 3 and TorchTitan train) or causal (every earlier token of the window, "
        "across documents). See docs/attention_masks.md", choices=("block_causal", "causal"),
    )
    attention_backend: str = field_with_help(
        "auto", "Attention score kernel: auto (context parallel under CP, else FlexAttention on CUDA or one SDPA per "
        "document on CPU for block_causal, causal SDPA for causal), sdpa (causal only), document_sdpa, flex (CUDA). "
        "Preflight refuses a backend that lacks what the run needs. See docs/models.md",
        choices=("auto", "sdpa", "document_sdpa", "flex"),
    )
    mtp_layers: int = field_with_help(
        0, "Multi-token prediction depths (DeepSeek-V3 report §2.2; deepseek_v3 only): each extra module predicts "
        "one token further ahead and adds its loss; 0 is off. See docs/models.md", min=0)
    mtp_loss_weight: float = field_with_help(
        0.3, "Weight lambda of the multi-token prediction loss: lambda / depths times the sum of the depths' "
        "losses is added to the main loss", min=0.0)
    converters: list[str] = field_with_help(
        [], "Model converters applied between build and parallelize: float8 (Float8 linears with torchao, "
        "configured by [float8]; docs/float8.md)")


@dataclass
class Optimizer:
    name: str = field_with_help(
        "AdamW", "Optimizer; Muon orthogonalizes the matrices' momentum and keeps AdamW (lr, eps, betas, "
        "weight_decay) for embeddings, output head, routers, norms and biases; MuonClip is Muon with QK-clip "
        "(docs/optimizers.md)",
        choices=("AdamW", "Adam", "Muon", "MuonClip"))
    lr: float = field_with_help(8e-4, "Peak learning rate", min=0.0)
    eps: float = field_with_help(1e-8, "Adam epsilon", min=0.0)
    weight_decay: float = field_with_help(0.1, "Decoupled weight decay", min=0.0)
    betas: list[float] = field_with_help([0.9, 0.95], "Adam beta1,beta2")
    muon_momentum: float = field_with_help(0.95, "Muon: momentum of the matrices' update (0..1)", min=0.0)
    muon_nesterov: bool = field_with_help(True, "Muon: Nesterov momentum (the update is grad + momentum * buffer)")
    muon_ns_steps: int = field_with_help(5, "Muon: Newton-Schulz iterations per matrix", min=1)
    muon_ns_dtype: str = field_with_help(
        "bfloat16", "Muon: dtype of the Newton-Schulz iteration (bfloat16 as the published recipe; float32 to "
        "compare layouts exactly)", choices=("bfloat16", "float32"))
    muon_update_scale: str = field_with_help(
        "match_adamw_rms", "Muon: scale of an m x n matrix's orthogonalized update; match_adamw_rms = "
        "0.2*sqrt(max(m, n)), AdamW's update RMS, so AdamW's lr and weight_decay carry over; shape_ratio = "
        "sqrt(max(1, m/n))", choices=("match_adamw_rms", "shape_ratio"))
    muon_split_heads: bool = field_with_help(
        False, "Muon: orthogonalize the attention's query, key and value projections head by head (one matrix per "
        "head's rows) instead of as one matrix each")
    muon_adamw_fqns: list[str] = field_with_help(
        [], "Muon: parameters whose name contains one of these go to AdamW too, besides the embeddings, output head, "
        "routers, norms and biases; a pattern that matches no parameter is refused")
    qk_clip_threshold: float = field_with_help(
        100.0, "MuonClip: the largest pre-softmax attention logit a head may reach; after each step the query and "
        "key weights of the heads above it are scaled down to it (must be positive)")


@dataclass
class LRScheduler:
    warmup_steps: int = field_with_help(200, "Steps of linear warmup from ~0 to the peak lr", min=0)
    decay_ratio: float | None = field_with_help(
        None, "Fraction of steps spent decaying at the end (unset: decay right after warmup)", min=0.0
    )
    decay_type: str = field_with_help("linear", "Shape of the decay", choices=("linear", "cosine", "sqrt"))
    lr_min: float = field_with_help(0.0, "Final lr as a fraction of the peak lr (0..1)", min=0.0)


@dataclass
class Training:
    dataset: str = field_with_help("embedded", "Dataset name from the registry (embedded, c4, ...)")
    dataset_path: str | None = field_with_help(
        None, "Token store folder (scripts/prepare_data.py), or local json/jsonl/parquet/text file or folder "
        "(prepared into a cached token store on first use); overrides the registry's source"
    )
    dataset_mix: list[dict] = field_with_help(
        [], "Weighted mixture of sources instead of dataset/dataset_path: in TOML [[training.dataset_mix]] tables "
        "with path (or dataset: a registry name or hub:NAME[:CONFIG], prepared into a cached token store on first "
        "use) and weight (optional: name, validation_path); on the CLI " + CLI_FORM
        + ". See docs/data.md", parse=parse_mix_entry)
    dataset_mix_new_phase: bool = field_with_help(
        False, "On resume, accept a dataset_mix that differs from the checkpoint's: a new phase starts at the "
        "resumed step, its order a function of the new mixture, the seed and that step (without it such a "
        "resume is refused)")
    shuffle: bool = field_with_help(True, "Token store: read the windows in a seeded order, another one each epoch")
    shuffle_seed: int = field_with_help(
        0, "Seed of that order; independent of training.seed, so the data stays put", min=0)
    batch_size: int = field_with_help(8, "Local batch size: sequences per data-parallel rank per micro-step", min=1)
    seq_len: int = field_with_help(2048, "Tokens per sequence", min=1)
    max_norm: float = field_with_help(1.0, "Gradient clipping: max global L2 norm (0 disables clipping)", min=0.0)
    steps: int = field_with_help(10000, "Optimizer steps to train", min=1)
    gradient_accumulation_steps: int = field_with_help(1, "Micro-steps per optimizer step", min=1)
    global_batch_size: int = field_with_help(
        -1, "Sequences per optimizer step over all ranks; -1 = batch_size * dp degree * accumulation steps"
    )
    mixed_precision_param: str = field_with_help(
        "auto", "FSDP parameter dtype for compute; auto = bfloat16 on GPU, float32 on CPU",
        choices=("auto", "bfloat16", "float32"),
    )
    mixed_precision_reduce: str = field_with_help(
        "float32", "Gradient reduction dtype", choices=("float32", "bfloat16"))
    compile: bool = field_with_help(False, "torch.compile each transformer block")
    cpu_matmul: str = field_with_help(
        "auto", "Float32 linear layers on CPU, eager: onednn = oneDNN's products (AVX-512 on any x86 CPU); aten = "
        "torch's default (MKL on x86, which keeps to AVX2 on AMD CPUs); auto = onednn on AMD/Hygon CPUs with "
        "AVX-512, aten elsewhere (benchmarks/README.md section 11). TP linears use aten",
        choices=("auto", "onednn", "aten"),
    )
    seed: int | None = field_with_help(None, "Base random seed; unset means no seeding (stated in the log)")
    deterministic: bool = field_with_help(False, "Use deterministic algorithms (slower)")
    seed_sharded_dims: list[str] = field_with_help(
        ["pp", "dp_shard", "cp", "ep", "tp"],
        "Mesh dims whose ranks get distinct seeds, first most significant; unlisted dims share seeds",
    )


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = field_with_help(1, "Replicas (DDP, or the replicate dim of HSDP)", min=1)
    data_parallel_shard_degree: int = field_with_help(
        -1, "FSDP shard degree; -1 = the ranks left over by the other degrees")
    tensor_parallel_degree: int = field_with_help(1, "Tensor parallel degree", min=1)
    enable_sequence_parallel: bool = field_with_help(True, "Shard norms/activations along the sequence under TP")
    disable_loss_parallel: bool = field_with_help(
        False, "Gather logits before the loss instead of vocab-parallel cross entropy")
    context_parallel_degree: int = field_with_help(1, "Context parallel degree (sequence sharding)", min=1)
    pipeline_parallel_degree: int = field_with_help(1, "Pipeline parallel degree", min=1)
    expert_parallel_degree: int = field_with_help(
        1, "Expert parallel degree: ranks among dp_shard x cp (x tp) that hold different experts of each MoE layer "
        "and exchange tokens by all-to-all (docs/moe.md); must divide the number of experts and dp_shard x cp, or "
        "else be a multiple of tp dividing dp_shard x cp x tp (it then borrows all of TP's ranks)", min=1)
    pipeline_parallel_schedule: str = field_with_help(
        "1F1B", "Pipeline schedule: GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, "
        "DualPipeV"
    )
    pipeline_parallel_microbatches: int | None = field_with_help(
        None, "Pipeline microbatches per local batch (unset = number of stages)", min=1
    )
    pipeline_parallel_stages_per_rank: int | None = field_with_help(
        None, "Stages per rank for multi-stage schedules (unset: 2, or implied by the split points)", min=1
    )
    pipeline_parallel_split_points: list[str] = field_with_help(
        [], "Layer FQNs where stages begin, e.g. layers.2,layers.4 (empty = split the layers evenly)"
    )
    pipeline_parallel_embedding_weight: int = field_with_help(
        0, "Even split: count the token embedding (first stage) as this many layers", min=0
    )
    pipeline_parallel_output_weight: int = field_with_help(
        0, "Even split: count the final norm + output projection (last stage) as this many layers", min=0
    )
    fsdp_reshard_after_forward: str = field_with_help(
        "default", "Free gathered params after forward: default (yes, except under PP), always, never",
        choices=("default", "always", "never"),
    )


@dataclass
class Moe:
    """Training choices for a model with experts (the experts' shapes come with the flavor); ignored by dense ones."""

    load_balance_coeff: float | None = field_with_help(
        None, "Auxiliary-loss-free balancing (DeepSeek-V3): before each optimizer step, each expert's routing bias "
        "moves by this much toward the mean of the tokens per expert, counted over the data ranks; 0 turns the bias "
        "off. Unset: the model family's default, the bias (1e-3) only where its Hugging Face format holds it (none "
        "of qwen3, mixtral, gpt_oss: 0), so that an export is the trained model", min=0.0)
    aux_loss: str = field_with_help(
        "none", "Auxiliary balance loss added to the training loss: none, switch (as Hugging Face's Qwen3-MoE and "
        "Mixtral) or sequence (DeepSeek-V3's sequence-wise loss)", choices=("none", "switch", "sequence"))
    aux_loss_coeff: float = field_with_help(1e-3, "Weight of the auxiliary balance loss", min=0.0)
    overlap_all_to_all: bool = field_with_help(
        True, "Under expert parallelism, send the routed tokens asynchronously and run the shared experts while they "
        "travel (forward, and their backward beside the returning gradients); the same model either way (docs/moe.md)")
    dispatch_gpus_per_node: int = field_with_help(
        0, "Under expert parallelism across nodes of this many consecutive ranks (GPUs per node), dispatch in two "
        "hops: each token crosses the network once per node holding one of its experts, then is forwarded inside the "
        "node, and each node's weighted outputs are summed there before the way back (docs/moe.md). The layouts then "
        "agree to rounding, not bit for bit. 0: one all-to-all over every EP rank", min=0)


@dataclass
class Float8:
    """Float8 training (``--model.converters float8``); the names are TorchTitan's (docs/float8.md)."""

    recipe_name: str = field_with_help(
        "tensorwise", "Scaling recipe: tensorwise (one scale per tensor; FP8 all-gather possible), rowwise (a scale "
        "per row), rowwise_with_gw_hp (rowwise, weight gradient in high precision)",
        choices=("tensorwise", "rowwise", "rowwise_with_gw_hp"))
    filter_fqns: list[str] = field_with_help(
        [], "Linears and routed experts whose FQN contains one of these stay in high precision, in addition to the "
        "output head and the MoE router gates (always) and any whose dims are not multiples of 16; each must match "
        "a linear or routed experts (feed_forward.experts: all of them)")
    enable_fsdp_float8_all_gather: bool = field_with_help(
        False, "FSDP all-gathers the weights in Float8 (tensorwise only): half the bytes of bf16")
    precompute_float8_dynamic_scale_for_fsdp: bool = field_with_help(
        False, "With the FP8 all-gather: compute every weight's scale in one all-reduce after the optimizer step "
        "instead of one per weight in forward")
    emulate: bool = field_with_help(
        False, "Emulate the FP8 products in high precision (for GPUs older than SM 8.9; the casts stay real)")


@dataclass
class Checkpoint:
    enable_checkpoint: bool = field_with_help(False, "Save and load checkpoints")
    folder: str = field_with_help("checkpoint", "Checkpoint folder, under the dump folder; or an object-store URI "
                                  "(s3://bucket/prefix, any fsspec URI), used as given (docs/object_storage.md)")
    interval: int = field_with_help(500, "Save every this many steps", min=1)
    keep_latest_k: int = field_with_help(0, "Keep only the newest k checkpoints (0 keeps all)", min=0)
    async_mode: str = field_with_help("disabled", "Checkpoint save mode", choices=("disabled", "async"))
    model_weights_only: bool = field_with_help(False, "Final save holds model weights only")
    export_dtype: str = field_with_help("float32", "Dtype of a weights-only export", choices=("float32", "bfloat16"))
    load_step: int = field_with_help(-1, "Step to load; -1 = latest complete checkpoint")
    checksums: bool = field_with_help(
        True, "Record a checksum of every file a save writes (in its manifest) and verify the files each rank "
        "reads at load: a damaged latest checkpoint falls back to the newest earlier one that verifies; "
        "see docs/checkpoint_integrity.md",
    )
    exclude_from_loading: list[str] = field_with_help([], "State keys not to load (e.g. optimizer,dataloader)")
    create_seed_checkpoint: bool = field_with_help(False, "Write an initialized step-0 checkpoint and exit")
    preemption_check_steps: int = field_with_help(
        10, "Every this many steps the ranks agree whether any got SIGTERM, and if so save that step and stop. "
        "The agreement is an all-reduce read on the host, which waits for the device; between checks a "
        "SIGTERM waits (at most this many steps) for the next check", min=1)
    initial_load_path: str | None = field_with_help(
        None, "Weights to start from when the run has no checkpoint of its own (its own checkpoint wins): "
        "a Hugging Face folder, a Meta folder, or a checkpoint of this project; see initial_load_format",
    )
    initial_load_format: str = field_with_help(
        "hf", "Format of initial_load_path: hf (*.safetensors + config.json), meta (consolidated.*.pth + "
        "params.json), dcp (a checkpoint folder of this project)", choices=("hf", "meta", "dcp"),
    )
    s3_connect_timeout_seconds: int = field_with_help(
        10, "Object store (s3://): seconds a connection to the store may take (docs/object_storage.md)", min=1)
    s3_read_timeout_seconds: int = field_with_help(
        30, "Object store (s3://): seconds a request may wait for the store to answer, or to take its body, "
        "before the attempt fails", min=1)
    s3_max_attempts: int = field_with_help(
        3, "Object store (s3://): attempts of one request, the first included (retried with a backoff after a "
        "timeout, throttling or a 5xx answer); a store that stops answering fails a request after about "
        "s3_max_attempts x s3_read_timeout_seconds", min=1)


@dataclass
class ActivationCheckpoint:
    mode: str = field_with_help("none", "Recompute activations in backward", choices=("none", "full", "selective"))
    selective_ac_option: str = field_with_help(
        "2", "Selective AC: 'op' (keep every second linear output and attention's), 'moe' (keep the all-to-alls, "
        "grouped expert GEMMs, attention and linears; recompute norms, activations, the router and MLA's "
        "up-projections), 'exchange' (keep only the expert dispatch's all-to-alls across nodes: with the two-hop "
        "dispatch its first hop's; recompute the rest) or N (every N-th block)")


@dataclass
class Metrics:
    log_freq: int = field_with_help(10, "Log metrics every this many steps", min=1)
    enable_tensorboard: bool = field_with_help(False, "Write TensorBoard event files")
    save_tb_folder: str = field_with_help("tb", "TensorBoard folder, under the dump folder")
    enable_wandb: bool = field_with_help(
        False, "Also log the scalars TensorBoard gets, and the effective config, to Weights & Biases from rank 0. "
        "Needs the wandb extra (pip install '.[wandb]'); WANDB_MODE=offline writes the run under the dump folder "
        "without network. A run resumed from a checkpoint continues the same W&B run (docs/metrics.md)")
    wandb_project: str = field_with_help("torchtitan", "W&B project the run goes to")
    wandb_entity: str | None = field_with_help(None, "W&B entity (user or team); unset: the account's default entity")
    wandb_run_name: str | None = field_with_help(None, "W&B run name; unset: the dump folder's name")
    wandb_group: str | None = field_with_help(
        None, "W&B group, which shows related runs together (e.g. the replica groups of one fault-tolerant job)")


@dataclass
class Profiling:
    enable_profiling: bool = field_with_help(False, "Record torch.profiler traces")
    save_traces_folder: str = field_with_help("profile_traces", "Trace folder, under the dump folder")
    profile_freq: int = field_with_help(10, "Profile every this many steps", min=1)


@dataclass
class Validation:
    enable: bool = field_with_help(False, "Evaluate the loss on held-out data during training")
    freq: int = field_with_help(500, "Validate every this many steps, and after the last step", min=1)
    steps: int = field_with_help(-1, "Validation batches per evaluation; -1 = the whole validation split once")
    dataset: str | None = field_with_help(
        None, "Registered dataset to validate on (e.g. c4_validation); unset: the held-out part of the training data"
    )
    dataset_path: str | None = field_with_help(
        None, "Local json/jsonl/parquet/text file or folder to validate on; overrides dataset"
    )
    held_out_fraction: float | None = field_with_help(
        None,
        "Fraction (0..1) of the training documents held out, chosen by hashing each document with split_seed; "
        "training never sees them, also while validation is disabled. Validation reads them unless dataset or "
        "dataset_path is set",
    )
    split_seed: int = field_with_help(0, "Seed of the held-out split (independent of training.seed)", min=0)
    batch_size: int | None = field_with_help(
        None, "Local validation batch: sequences per data-parallel rank (unset = training's)", min=1)


@dataclass
class Eval:
    tasks: list[str] = field_with_help(
        [], "Multiple-choice tasks scored during training: JSONL files ({context, choices, label} a line, named by "
        "the file's stem) or the shipped task 'continuation'; empty = off (docs/evaluation.md)")
    freq: int = field_with_help(500, "Score the tasks every this many steps, and after the last step", min=1)
    limit: int | None = field_with_help(None, "Score at most this many requests of each task (unset = all)", min=1)
    batch_size: int | None = field_with_help(
        None, "Rows (one request's choice each) per data-parallel rank and forward (unset = training's batch)",
        min=1)


@dataclass
class Comm:
    init_timeout_seconds: int = field_with_help(300, "Timeout for process-group set-up and the first step", min=1)
    train_timeout_seconds: int = field_with_help(
        100, "Collective timeout after the first step, on every process group (checkpoint saves too)", min=1)


@dataclass
class FaultTolerance:
    enable: bool = field_with_help(
        False, "Fault-tolerant HSDP with torchft: this torchrun job is one replica group of several")
    replica_id: int = field_with_help(
        0, "This group's id, 0 <= replica_id < num_replica_groups; fixes its data slots", min=0)
    num_replica_groups: int = field_with_help(
        1, "The most replica groups the job may have; the data is laid out for all of them", min=1)
    min_replicas: int = field_with_help(1, "Fewest live groups a step may commit with", min=1)
    lighthouse: str | None = field_with_help(
        None, "torchft lighthouse address, e.g. http://host:29510; unset = $TORCHFT_LIGHTHOUSE")
    timeout_seconds: int = field_with_help(
        30, "torchft timeout of the cross-group all-reduce, commit vote and heal transfer; keep it below "
        "--comm.train_timeout_seconds", min=1)
    quorum_timeout_seconds: int = field_with_help(60, "How long a step waits for the quorum of live groups", min=1)
    startup_timeout_seconds: int = field_with_help(
        60, "How long a group's first step (also after a whole-job restart; diloco/local_sgd: its first sync) "
        "waits for all num_replica_groups groups before it may commit with fewer, down to min_replicas "
        "(0 = no wait); see docs/fault_tolerance_startup.md", min=0)
    connect_timeout_seconds: int = field_with_help(
        10, "Timeout of connecting to the lighthouse and a peer's manager", min=1)
    quorum_retries: int = field_with_help(
        3, "Quorum attempts retried before a group gives up (a restarted lighthouse)", min=0)
    replica_check_freq: int = field_with_help(
        0, "Compare a fingerprint of weights and optimizer state across groups every N steps (0 = off); "
        "diloco/local_sgd: of the global state (reference parameters, outer momentum) every N syncs", min=0)
    semi_sync_method: str = field_with_help(
        "none", "Cross-group synchronisation: none (all-reduce every step), diloco or local_sgd",
        choices=("none", "diloco", "local_sgd"))
    sync_steps: int = field_with_help(
        20, "diloco/local_sgd: inner (group-local) steps between two syncs of the whole model", min=1)
    num_fragments: int = field_with_help(
        1, "diloco: model fragments synchronised in turn, one every sync_steps / num_fragments steps", min=1)
    fragment_sync_delay: int = field_with_help(
        0, "diloco: inner steps a fragment's all-reduce may overlap before its outer step; < sync_steps / "
        "num_fragments", min=0)
    fragment_update_alpha: float = field_with_help(
        0.0, "diloco: weight of the local parameters when merging a synced fragment, in [0, 1] (0 = the global "
        "ones)", min=0.0)
    outer_lr: float = field_with_help(0.7, "diloco: learning rate of the outer (Nesterov SGD) optimizer", min=0.0)
    outer_momentum: float = field_with_help(0.9, "diloco: momentum of the outer optimizer", min=0.0)


@dataclass
class Stability:
    """Bad steps skipped on the device, a rollback after too many in a row, and z-loss (docs/stability.md)."""

    skip_nonfinite_steps: bool = field_with_help(
        False, "Skip the optimizer step (Adam moments and step count untouched) whose loss or gradient norm is not "
        "finite, instead of stopping at the next logged loss")
    skip_spikes: bool = field_with_help(
        False, "Skip a step whose loss or gradient norm exceeds its running mean by sigma_factor standard "
        "deviations over the last rolling_interval_length accepted steps")
    sigma_factor: float = field_with_help(6.0, "Spike threshold in standard deviations above the running mean",
                                          min=0.0)
    rolling_interval_length: int = field_with_help(
        128, "Accepted steps whose loss and gradient norm make the running mean and standard deviation", min=2)
    spike_warmup_steps: int = field_with_help(
        64, "Accepted steps before the spike detector may skip one (at least 2, at most rolling_interval_length)",
        min=2)
    max_consecutive_skips: int = field_with_help(
        0, "After this many skipped steps in a row, reload the last checkpoint and skip the data that followed it "
        "(0 = never; needs checkpoint.enable_checkpoint)", min=0)
    z_loss_multiplier: float = field_with_help(
        0.0, "z-loss coefficient (PaLM, OLMo: 1e-4): adds multiplier * logsumexp(logits)^2 per token to the "
        "trained loss; logged as z_loss apart from loss (0 = off)", min=0.0)

    @property
    def guards_steps(self) -> bool:
        """Whether steps are checked before the optimizer step at all."""
        return self.skip_nonfinite_steps or self.skip_spikes


@dataclass
class Debug:
    inject_nonfinite_grad: list[int] = field_with_help(
        [], "For tests and drills: make a gradient NaN on every rank at these steps (e.g. 5,9), after the "
        "backward, so the bad-step handling of [stability] can be watched")


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    moe: Moe = field(default_factory=Moe)
    float8: Float8 = field(default_factory=Float8)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    validation: Validation = field(default_factory=Validation)
    eval: Eval = field(default_factory=Eval)
    comm: Comm = field(default_factory=Comm)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
    stability: Stability = field(default_factory=Stability)
    debug: Debug = field(default_factory=Debug)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {
            s.name: {f.name: getattr(getattr(self, s.name), f.name) for f in fields(getattr(self, s.name))}
            for s in fields(self)
        }
