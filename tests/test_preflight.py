"""Preflight, the one place that checks a job: every problem named with its fix, before any process group exists."""

from __future__ import annotations

import pytest
import torch
from conftest import DEBUG_CONFIG, REPO, SHIPPED_TOKENIZER, debug_config

from torchtitan.config import ConfigError, ConfigManager
from torchtitan.datasets import build_tokenizer
from torchtitan.models.llama3 import ffn_hidden_dim, llama3_flavors
from torchtitan.preflight import check_config, gradient_accumulation_steps, preflight

DEBUG = DEBUG_CONFIG


def parse(*argv: str):
    return ConfigManager().parse_args(list(argv))


@pytest.mark.parametrize(
    "arg, needle",
    [
        ("--parallelism.data_parallel_shard_degree=0", "-1 (the ranks left over)"),
        ("--parallelism.data_parallel_shard_degree=-3", "-1 (the ranks left over)"),
        ("--lr_scheduler.lr_min=2", "fraction of the peak lr"),
        ("--lr_scheduler.decay_ratio=1.5", "it is a fraction (0..1)"),
        ("--optimizer.betas=0.9", "two values"),
        ("--optimizer.betas=0.9,1.0", "two values"),
        ("--training.seed_sharded_dims=pp,xx", "unknown dim(s) xx"),
        ("--training.seed_sharded_dims=tp,tp", "listed twice"),
        ("--model.flavor=9B", "choose one of debugmodel"),
        # The families are the model registry's (tests/models/test_registry.py), checked here, not by the parser.
        ("--model.name=gpt", "--model.name=gpt: unknown model family; choose one of llama3"),
        ("--training.global_batch_size=0", "positive size"),
        ("--training.dataset=nope", "--training.dataset=nope: unknown; choose one of"),
        ("--training.dataset_path=/no/such/file.jsonl", "no such file or folder"),
    ],
)
def test_values_a_type_cannot_express(arg, needle):
    msgs = check_config(parse(arg))
    assert len(msgs) == 1 and needle in msgs[0], msgs


@pytest.mark.parametrize("option", ["x", "0", "-1", "1.5", "", "MoE"])
def test_selective_ac_option_is_checked_before_any_process_group(option):
    # It used to be checked only while the model was wrapped, after the process group existed.
    args = ["--activation_checkpoint.mode=selective", f"--activation_checkpoint.selective_ac_option={option}"]
    (line,) = check_config(parse(*args))
    assert line.startswith(f"--activation_checkpoint.selective_ac_option={option}: use 'op', 'moe', 'exchange' or a "
                           "positive")
    assert check_config(parse("--activation_checkpoint.mode=full",
                              "--activation_checkpoint.selective_ac_option=x")) == []
    for good in ("op", "moe", "exchange", "1", "3"):
        assert check_config(parse("--activation_checkpoint.mode=selective",
                                  f"--activation_checkpoint.selective_ac_option={good}")) == []


def test_every_problem_is_reported_at_once():
    cfg = parse("--job.config_file", DEBUG, "--model.flavor=9B", "--optimizer.betas=0.9",
                "--parallelism.data_parallel_shard_degree=3", "--model.tokenizer_path=/no/tokenizer.model")
    with pytest.raises(ConfigError) as info:
        preflight(cfg, 4)
    text = "\n".join(info.value.problems)
    assert len(info.value.problems) == 4, text
    for needle in ("--model.flavor=9B", "--optimizer.betas", "--parallelism.data_parallel_shard_degree=3 = 3, but "
                   "world_size=4", "--model.tokenizer_path"):
        assert needle in text


@pytest.mark.parametrize("overrides, world, start, fix", [
    (["--parallelism.tensor_parallel_degree=3"], 2, "--parallelism.tensor_parallel_degree=3 does not divide the "
     "number of ranks (world_size=2)", "set --parallelism.tensor_parallel_degree to 1 or 2, or launch a multiple of 3"),
    (["--parallelism.pipeline_parallel_degree=2", "--parallelism.context_parallel_degree=2"], 6,
     "--parallelism.pipeline_parallel_degree=2 x --parallelism.context_parallel_degree=2 = 4 does not divide",
     "change them so their product divides it"),
    (["--parallelism.data_parallel_shard_degree=2", "--parallelism.tensor_parallel_degree=2"], 8,
     "--parallelism.data_parallel_shard_degree=2 x --parallelism.tensor_parallel_degree=2 = 4, but world_size=8",
     "or set --parallelism.data_parallel_shard_degree=-1"),
])
def test_a_degree_that_does_not_fit_the_world_names_the_option(overrides, world, start, fix):
    # One line, starting with the options as typed, ending with the fix.
    problems = _problems(world, "--parallelism.data_parallel_shard_degree=-1", *overrides)
    assert len(problems) == 1 and problems[0].startswith(start) and fix in problems[0], problems


def test_shipped_defaults_pass():
    assert check_config(parse()) == []
    assert check_config(parse("--job.config_file", DEBUG)) == []


def test_gradient_accumulation_from_global_batch():
    cfg = parse("--training.batch_size=2", "--training.global_batch_size=16")
    assert gradient_accumulation_steps(cfg, dp_degree=4) == (2, [])
    assert gradient_accumulation_steps(parse("--training.gradient_accumulation_steps=3"), dp_degree=4) == (3, [])
    _, (problem,) = gradient_accumulation_steps(cfg, dp_degree=3)
    assert "is not a multiple of batch_size (2) x data-parallel degree (3) = 6" in problem
    bad = parse("--training.batch_size=2", "--training.global_batch_size=16",
                "--training.gradient_accumulation_steps=4")
    _, (problem,) = gradient_accumulation_steps(bad, dp_degree=4)
    assert "contradicts global_batch_size=16 (which implies 2)" in problem
    # In preflight it is one problem among the others, before any process group.
    with pytest.raises(ConfigError, match="not a multiple"):
        preflight(parse("--job.config_file", DEBUG, "--training.global_batch_size=6"), 4)


def test_validation_options():
    for bad in ("0", "1", "1.5", "-0.1"):
        (line,) = check_config(parse(f"--validation.held_out_fraction={bad}"))
        assert line.startswith(f"--validation.held_out_fraction={float(bad)}: give a fraction strictly between 0 and 1")
    for bad in ("0", "-2"):
        (line,) = check_config(parse(f"--validation.steps={bad}"))
        assert "or -1 for the whole split" in line
    (line,) = check_config(parse("--validation.enable"))
    assert "--validation.enable needs data" in line and "--validation.held_out_fraction" in line
    # Both: training leaves the fraction out, validation reads the dataset (e.g. those documents, prepared).
    assert check_config(parse("--validation.held_out_fraction=0.1", "--validation.dataset=c4_validation")) == []
    (line,) = check_config(parse("--validation.enable", "--validation.dataset=nope"))
    assert line.startswith("--validation.dataset=nope: unknown")
    (line,) = check_config(parse("--validation.enable", "--validation.dataset_path=/no/val.jsonl"))
    assert line == "--validation.dataset_path=/no/val.jsonl: no such file or folder"
    assert check_config(parse("--validation.enable", "--validation.held_out_fraction=0.01")) == []


def _problems(world_size: int, *overrides: str) -> list[str]:
    cfg = debug_config(*overrides)
    with pytest.raises(ConfigError) as info:
        preflight(cfg, world_size)
    return info.value.problems


def test_tp_degree_must_divide_heads_dim_and_vocab():
    # The debug model's sizes, and the vocabulary its config's tokenizer gives it.
    debug, vocab = llama3_flavors["debugmodel"], build_tokenizer(SHIPPED_TOKENIZER).n_words
    problems = _problems(3, "--parallelism.tensor_parallel_degree=3", "--parallelism.data_parallel_shard_degree=1",
                         "--training.seq_len=63")
    text = "\n".join(problems)
    sizes = {f"n_heads ({debug.n_heads})": debug.n_heads, f"n_kv_heads ({debug.n_kv_heads})": debug.n_kv_heads,
             f"dim ({debug.dim})": debug.dim, f"vocab size {vocab}": vocab,
             f"FFN hidden size ({ffn_hidden_dim(debug)})": ffn_hidden_dim(debug)}
    assert any(size % 3 for size in sizes.values()), "the debug model no longer exercises this check"
    for what, size in sizes.items():
        assert (what in text) == bool(size % 3), what  # named exactly when 3 does not divide it
    assert all("tensor_parallel_degree=3" in p or "seq_len" in p for p in problems)


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["--parallelism.context_parallel_degree=2", "--training.seq_len=66"],
         "seq_len=66 must be divisible by 2 * context_parallel_degree (4, load-balanced chunks) = 4; change seq_len"),
        (["--parallelism.tensor_parallel_degree=2", "--training.seq_len=65"],
         "= 2; change seq_len or set --parallelism.enable_sequence_parallel=false"),
        (["--parallelism.tensor_parallel_degree=2", "--parallelism.context_parallel_degree=2", "--training.seq_len=68"],
         "(4, load-balanced chunks) x tensor_parallel_degree (2, sequence parallel) = 8"),
    ],
)
def test_sequence_length_must_split_evenly(overrides, needle):
    problems = _problems(4, "--parallelism.data_parallel_shard_degree=-1", *overrides)
    assert len(problems) == 1 and needle in problems[0], problems


def test_valid_tp_cp_layouts_pass():
    for overrides in (["--parallelism.tensor_parallel_degree=2"], ["--parallelism.context_parallel_degree=2"],
                      ["--parallelism.tensor_parallel_degree=2", "--parallelism.enable_sequence_parallel=false",
                       "--training.seq_len=66"]):
        cfg = ConfigManager().parse_args(["--job.config_file", DEBUG, "--parallelism.data_parallel_shard_degree=-1",
                                          *overrides])
        assert preflight(cfg, 8).dims.world_size == 8


def test_compile_passes_in_every_tensor_parallel_layout():
    # torch.compile trains under TP (tests/distributed/test_compile_tp.py): the preflight lets it through.
    tp2 = "--parallelism.tensor_parallel_degree=2"
    for world_size, overrides in ((2, [tp2]), (2, [tp2, "--parallelism.enable_sequence_parallel=false"]),
                                  (4, [tp2]), (4, [tp2, "--parallelism.context_parallel_degree=2"]),
                                  (4, [tp2, "--parallelism.pipeline_parallel_degree=2", "--training.batch_size=2"])):
        cfg = ConfigManager().parse_args(["--job.config_file", DEBUG, "--parallelism.data_parallel_shard_degree=-1",
                                          *overrides, "--training.compile"])
        assert cfg.training.compile
        assert preflight(cfg, world_size).dims.tp == 2, overrides


@pytest.mark.parametrize("ac", [["--activation_checkpoint.mode=full"], ["--activation_checkpoint.mode=selective",
                                                                        "--activation_checkpoint.selective_ac_option=2"]])
def test_compiled_tp_with_whole_block_ac_is_refused_on_torch_2_13_alone(ac):
    cfg = ConfigManager().parse_args(["--job.config_file", DEBUG, "--parallelism.tensor_parallel_degree=2",
                                      "--parallelism.data_parallel_shard_degree=1", "--training.compile", *ac])
    if torch.__version__.startswith("2.13."):
        with pytest.raises(ConfigError) as info:
            preflight(cfg, 2)
        assert len(info.value.problems) == 1, info.value.problems
        assert f"fails in torch {torch.__version__}" in info.value.problems[0]
        assert "selective_ac_option=op" in info.value.problems[0]
    else:
        assert preflight(cfg, 2).dims.tp == 2
    # Op-level selective AC compiles under TP on 2.13 too, and the planner (check_data=False) plans for the
    # cluster's torch: neither is refused.
    for per_op in ("op", "moe"):
        op_ac = ConfigManager().parse_args(["--job.config_file", DEBUG, "--parallelism.tensor_parallel_degree=2",
                                            "--parallelism.data_parallel_shard_degree=1", "--training.compile",
                                            "--activation_checkpoint.mode=selective",
                                            f"--activation_checkpoint.selective_ac_option={per_op}"])
        assert preflight(op_ac, 2).dims.tp == 2
    assert preflight(cfg, 2, check_data=False).dims.tp == 2


def test_warmup_longer_than_the_run_is_a_config_error():
    problems = _problems(1, "--training.steps=3", "--lr_scheduler.warmup_steps=5")
    assert any("--lr_scheduler.warmup_steps=5" in p and "training.steps=3" in p for p in problems), problems


MOE_CONFIG = str(REPO / "train_configs" / "qwen3_debug_moe.toml")


@pytest.mark.parametrize("overrides, world, needle", [
    (["--parallelism.expert_parallel_degree=3", "--parallelism.data_parallel_shard_degree=6"], 6,
     "--parallelism.expert_parallel_degree=3 does not divide the 8 experts of --model.flavor=debugmodel_moe"),
    (["--parallelism.expert_parallel_degree=4", "--parallelism.data_parallel_shard_degree=2"], 2,
     "--parallelism.expert_parallel_degree=4 must divide dp_shard x cp x tp = 2 x 1 x 1 = 2"),
    # Borrowing from TP: ep must divide dp_shard x cp x tp, and cover all of TP.
    (["--parallelism.expert_parallel_degree=8", "--parallelism.data_parallel_shard_degree=2",
      "--parallelism.tensor_parallel_degree=2"], 4,
     "--parallelism.expert_parallel_degree=8 must divide dp_shard x cp x tp = 2 x 1 x 2 = 4"),
    (["--parallelism.expert_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1",
      "--parallelism.tensor_parallel_degree=4"], 4,
     "--parallelism.expert_parallel_degree=2 needs the ranks of --parallelism.tensor_parallel_degree=4"),
    # Borrowing TP's ranks, each MoE layer takes its TP rank's sequence shard even without SP.
    (["--parallelism.expert_parallel_degree=4", "--parallelism.data_parallel_shard_degree=2",
      "--parallelism.tensor_parallel_degree=2", "--parallelism.enable_sequence_parallel=false",
      "--training.seq_len=65"], 4,
     "--training.seq_len=65 must be divisible by tensor_parallel_degree (2, expert parallelism borrows its ranks) = 2"
     "; change seq_len"),
    (["--parallelism.expert_parallel_degree=2", "--model.name=llama3", "--model.flavor=debugmodel"], 2,
     "--model.name=llama3 --model.flavor=debugmodel has no experts; set it to 1"),
    (["--fault_tolerance.enable", "--fault_tolerance.num_replica_groups=2",
      "--fault_tolerance.lighthouse=http://h:1", "--moe.load_balance_coeff=0.001"], 2,
     "--moe.load_balance_coeff=0.001 with --fault_tolerance.enable"),
])
def test_expert_parallel_and_balancing_bad_inputs_one_line_each(overrides, world, needle):
    # Preflight runs before the process group exists: every rank raises the same line, nothing hangs.
    with pytest.raises(ConfigError) as e:
        preflight(debug_config(*overrides, config=MOE_CONFIG), world)
    assert len(e.value.problems) == 1 and needle in e.value.problems[0], e.value.problems


def test_expert_parallel_layouts_pass_and_balancing_options_reach_the_model():
    cfg = debug_config("--parallelism.expert_parallel_degree=4", "--parallelism.context_parallel_degree=2",
                       "--parallelism.data_parallel_shard_degree=2", "--moe.aux_loss=switch",
                       "--moe.load_balance_coeff=0", config=MOE_CONFIG)
    plan = preflight(cfg, 4)
    assert (plan.dims.ep, plan.dims.degree("efsdp")) == (4, 1)
    assert not plan.dims.ep_borrows_tp
    args = plan.model_args
    assert (args.load_balance_coeff, args.aux_loss, args.aux_loss_coeff) == (0.0, "switch", 1e-3)
    # EP 4 on TP 2 x FSDP 2 borrows TP's ranks (dp_shard x cp = 2 cannot hold 4), with SP and without it.
    for sp in ("true", "false"):
        borrowed = preflight(debug_config("--parallelism.expert_parallel_degree=4",
                                          "--parallelism.tensor_parallel_degree=2",
                                          "--parallelism.data_parallel_shard_degree=2",
                                          f"--parallelism.enable_sequence_parallel={sp}", config=MOE_CONFIG), 4)
        assert borrowed.dims.ep_borrows_tp and borrowed.dims.degree("efsdp") == 1
    assert not args.moe_args().load_balance_bias


# torch modules the launcher's preflight (a process of its own before torchrun: run_llama_train.sh) has no use
# for: DCP and pipelining (which imports the compiler stack) cost it about 1.2 s of CPU a launch (4.0 to 2.8 s).
_NOT_FOR_THE_PREFLIGHT = ("torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.pipelining")
_PREFLIGHT_IMPORTS = """
import runpy, sys
config, unwanted = sys.argv[1], sys.argv[2:]
sys.argv = ["train.py", "--preflight_only", "--job.config_file", config]
try:
    runpy.run_path("train.py", run_name="__main__")
except SystemExit as e:
    assert e.code == 0, e.code
print(",".join(m for m in unwanted if m in sys.modules))
"""


@pytest.mark.slow  # starts a Python process: the imports of this one are the suite's
def test_the_launch_preflight_imports_neither_dcp_nor_pipelining():
    import subprocess
    import sys

    from conftest import CI_CONFIG

    done = subprocess.run([sys.executable, "-c", _PREFLIGHT_IMPORTS, CI_CONFIG, *_NOT_FOR_THE_PREFLIGHT], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "", f"the preflight imported {done.stdout.strip()}"
