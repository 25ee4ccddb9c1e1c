"""Real Llama 3 releases in and out: shapes from the published configs, tied embeddings, faithful exports.

The published ``config.json`` values of Llama 3.2 1B, 3.2 3B and 3.1 8B are written by the test.
At full size they are read on the meta device (shapes and parameter counts). For training they
are cut to 2 layers, 8-wide heads (the head counts, GQA ratio, rope and tying kept) and the
shipped 2048-word tokenizer's vocabulary, saved by ``transformers`` itself, and loaded with
``--model.flavor <folder>``: the step-1 loss must be ``transformers``' own.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch
import transformers
from conftest import DEBUG_CONFIG, REPO, debug_config, run_torchrun, torchrun_env
from dist_harness import run_ranks
from helpers import hf_loss

from torchtitan.checkpoint.formats import check_source, load_into
from torchtitan.config import ConfigError, ConfigManager
from torchtitan.models import model_args
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.llama3 import llama3_flavors
from torchtitan.models.llama3.convert import model_fields
from torchtitan.preflight import preflight

DEBUG_TOML = DEBUG_CONFIG
SEQ, BATCH, VOCAB = 32, 2, 2048
_ROPE = {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8192,
         "rope_type": "llama3"}
_COMMON = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
           "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu",
           "initializer_range": 0.02, "max_position_embeddings": 131072, "mlp_bias": False, "pretraining_tp": 1,
           "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "torch_dtype": "bfloat16", "use_cache": True,
           "vocab_size": 128256}
# The published config.json values (Hugging Face hub, meta-llama/*).
PUBLISHED = {
    "3.2-1B": {**_COMMON, "head_dim": 64, "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32,
               "num_hidden_layers": 16, "num_key_value_heads": 8, "rope_scaling": _ROPE, "tie_word_embeddings": True},
    "3.2-3B": {**_COMMON, "head_dim": 128, "hidden_size": 3072, "intermediate_size": 8192, "num_attention_heads": 24,
               "num_hidden_layers": 28, "num_key_value_heads": 8, "rope_scaling": _ROPE, "tie_word_embeddings": True},
    "3.1-8B": {**_COMMON, "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
               "num_hidden_layers": 32, "num_key_value_heads": 8, "rope_scaling": {**_ROPE, "factor": 8.0},
               "tie_word_embeddings": False},
}
PARAM_COUNTS = {"3.2-1B": 1_235_814_400, "3.2-3B": 3_212_749_824, "3.1-8B": 8_030_261_248}
NAMED = {"3.2-1B": "1B", "3.2-3B": "3B", "3.1-8B": "8B"}


def write_json(folder: Path, name: str, content: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(content))
    return folder


def cut(config: dict, head_width: int = 8) -> dict:
    """2 layers, narrow heads, the tokenizer's vocabulary; head counts, GQA, FFN ratio, rope, tying kept."""
    hidden = config["num_attention_heads"] * head_width
    out = {**config, "num_hidden_layers": 2, "hidden_size": hidden, "vocab_size": VOCAB,
           "intermediate_size": config["intermediate_size"] * hidden // config["hidden_size"],
           "bos_token_id": 1, "eos_token_id": 2}
    if "head_dim" in config:
        out["head_dim"] = head_width
    return out


def test_published_configs_give_the_released_shapes(tmp_path) -> None:
    for name, config in PUBLISHED.items():
        folder = write_json(tmp_path / name, "config.json", config)
        for path in (folder, folder / "config.json"):
            args = model_args("llama3", str(path))
            with torch.device("meta"):
                assert Decoder(args).num_params() == PARAM_COUNTS[name], name
            assert model_fields(args) == model_fields(llama3_flavors[NAMED[name]]), name
    # Llama 3.0: no rope scaling.
    folder = write_json(tmp_path / "3.0-8B", "config.json", {**PUBLISHED["3.1-8B"], "rope_scaling": None,
                                                              "max_position_embeddings": 8192})
    args = model_args("llama3", str(folder))
    assert not args.rope_scaling and args.rope_scaling_params() is None and args.max_seq_len == 8192
    # Meta's params.json of 3.2 1B (no scaling factor, no tying stated: those of the release of that shape).
    params = {"dim": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8, "vocab_size": 128256,
              "ffn_dim_multiplier": 1.5, "multiple_of": 256, "norm_eps": 1e-05, "rope_theta": 500000.0,
              "use_scaled_rope": True}
    meta = write_json(tmp_path / "meta-1B" / "original", "params.json", params).parent
    assert model_fields(model_args("llama3", str(meta))) == model_fields(llama3_flavors["1B"])


def test_unsupported_releases_are_one_line_preflight_errors(tmp_path) -> None:
    def problems(flavor: Path, *extra: str) -> list[str]:
        cfg = debug_config(f"--model.flavor={flavor}", *extra)
        with pytest.raises(ConfigError) as e:
            preflight(cfg, 2)
        return e.value.problems

    mistral = write_json(tmp_path / "mistral", "config.json", {**PUBLISHED["3.1-8B"], "model_type": "mistral",
                                                                "architectures": ["MistralForCausalLM"]})
    (line,) = problems(mistral)
    assert "architecture ['MistralForCausalLM'] is not supported; only LlamaForCausalLM" in line, line
    yarn = write_json(tmp_path / "yarn", "config.json", {**PUBLISHED["3.1-8B"], "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0}})
    (line,) = problems(yarn)
    assert "rope type 'yarn' is not supported" in line, line
    (line,) = problems(tmp_path / "nothing")
    assert "neither a flavor name nor a release" in line, line
    tied = write_json(tmp_path / "tied", "config.json", cut(PUBLISHED["3.2-1B"]))
    (line,) = problems(tied, "--parallelism.pipeline_parallel_degree=2", "--training.batch_size=2")
    assert "ties the output projection to the embedding, which pipeline parallelism does not support" in line


# ---------------------------------------------------------------- small real models, trained


def hf_release(folder: Path, config: dict, seed: int) -> Path:
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**config, "initializer_range": 0.1}))
    model.save_pretrained(folder)
    return folder


def meta_release(folder: Path, hf_dir: Path) -> Path:
    """The same weights as Meta lays them out (our names, one consolidated file, params.json)."""
    args = model_args("llama3", str(hf_dir))
    model = Decoder(args)
    load_into(model, str(hf_dir), "hf", args)
    folder.mkdir()
    torch.save(dict(model.state_dict()), folder / "consolidated.00.pth")
    scaling = args.rope_scaling_params()
    write_json(folder, "params.json", {
        "dim": args.dim, "n_layers": args.n_layers, "n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads,
        "vocab_size": args.vocab_size, "multiple_of": 256, "ffn_dim_multiplier": None, "norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta, "use_scaled_rope": scaling is not None,
        "rope_scaling_factor": scaling["factor"], "tie_word_embeddings": args.tie_word_embeddings})
    return folder


@pytest.fixture(scope="module")
def releases(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("releases")
    out = {name: hf_release(root / name, cut(config), seed) for seed, (name, config) in enumerate(PUBLISHED.items())}
    return out




def _release_runs(rank: int, world_size: int, dump: str, runs: dict[str, list[str]]) -> dict:
    from torchtitan.trainer import Trainer

    out = {}
    for name, overrides in runs.items():
        folder = name.removesuffix(" resumed")  # resumes that run from its own checkpoint
        cfg = ConfigManager().parse_args([
            "--job.config_file", DEBUG_TOML, f"--job.dump_folder={dump}/{folder}", "--job.print_args=false",
            "--metrics.enable_tensorboard=false", f"--training.seq_len={SEQ}", f"--training.batch_size={BATCH}",
            "--training.steps=2", "--lr_scheduler.warmup_steps=0",
            "--model.attn_mask_type=causal",  # transformers' loss attends across the packed documents
            *overrides])
        trainer = Trainer(cfg)
        model = trainer.model_parts[0]
        whole = model.output is not None and model.tok_embeddings is not None  # not a pipeline stage
        tied = whole and model.output.weight is model.tok_embeddings.weight
        out[name] = {"losses": trainer.train(), "tied": tied,
                     "n_params": sum(p.numel() for p in model.parameters())}
    return out


@pytest.mark.slow
def test_real_configs_load_and_train_tied_in_fsdp_tp_pp(releases, tmp_path) -> None:
    """One two-rank world: 3.2 1B-shaped (tied) into TP 2 (and resumed), FSDP 2 and CP 2 from HF, 3.2 3B-shaped (tied)
    into FSDP 2 from Meta's layout, 3.1 8B-shaped into PP 2: step-1 loss = transformers' loss on the same batch."""
    meta_3b = meta_release(tmp_path / "meta-3B", releases["3.2-3B"])

    def hf(name: str) -> list[str]:
        return [f"--model.flavor={releases[name]}", f"--checkpoint.initial_load_path={releases[name]}",
                "--checkpoint.initial_load_format=hf"]

    # Three steps, saved after the second; the resumed run loads that checkpoint and retrains step 3.
    tp2 = [*hf("3.2-1B"), "--parallelism.tensor_parallel_degree=2", "--checkpoint.enable_checkpoint",
           "--training.steps=3", "--checkpoint.interval=2"]
    runs = {"1B tp2": tp2, "1B tp2 resumed": [*tp2, "--checkpoint.load_step=2"],
            "1B fsdp2": [*hf("3.2-1B"), "--parallelism.data_parallel_shard_degree=2"],
            "1B cp2": [*hf("3.2-1B"), "--parallelism.context_parallel_degree=2"],
            "3B meta fsdp2": [f"--model.flavor={meta_3b}", f"--checkpoint.initial_load_path={meta_3b}",
                              "--checkpoint.initial_load_format=meta", "--parallelism.data_parallel_shard_degree=2"],
            "8B pp2": [*hf("3.1-8B"), "--parallelism.pipeline_parallel_degree=2",
                       "--parallelism.pipeline_parallel_schedule=GPipe"]}
    results = run_ranks(_release_runs, 2, str(tmp_path / "dump"), runs, timeout=300)
    source = {"1B tp2": "3.2-1B", "1B fsdp2": "3.2-1B", "1B cp2": "3.2-1B", "3B meta fsdp2": "3.2-3B",
              "8B pp2": "3.1-8B"}
    for name, release in source.items():
        got = results[0][name]
        assert got["losses"] == results[1][name]["losses"], name
        dp = 2 if "fsdp2" in name else 1
        assert got["losses"][0] == pytest.approx(hf_loss(releases[release], dp * BATCH), rel=1e-5), name
        assert got["losses"][1] != got["losses"][0], name  # it trains
    for name in ("1B tp2", "1B tp2 resumed", "1B fsdp2", "1B cp2", "3B meta fsdp2"):
        assert results[0][name]["tied"] and results[1][name]["tied"], name
    # Its own tied checkpoint (both names) loads, and step 3 from it is bitwise the uninterrupted run's step 3.
    for rank in (0, 1):
        assert results[rank]["1B tp2 resumed"]["losses"] == results[rank]["1B tp2"]["losses"][2:], rank
    # The tied parameter count, as transformers counts the same release.
    hf_1b = transformers.LlamaForCausalLM.from_pretrained(releases["3.2-1B"])
    assert results[0]["1B fsdp2"]["n_params"] == hf_1b.num_parameters()


def _export_script():
    """scripts/export_checkpoint.py as a module (called in-process: no second interpreter start)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("export_checkpoint", REPO / "scripts" / "export_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_torchrun_tied_release_round_trip(releases, tmp_path, capsys) -> None:
    """train.py under torchrun (FSDP 2) from a tied 3.2 1B-shaped release; the export loads back tied."""
    from safetensors import safe_open

    release, dump = releases["3.2-1B"], tmp_path / "dump"
    out = run_torchrun(
        REPO / "train.py", "--job.config_file", DEBUG_TOML, f"--job.dump_folder={dump}",
        "--metrics.enable_tensorboard=false",
        "--model.attn_mask_type=causal",  # transformers' loss attends across the packed documents
        f"--model.flavor={release}", f"--training.seq_len={SEQ}", f"--training.batch_size={BATCH // 2}",
        "--training.steps=1", "--parallelism.data_parallel_shard_degree=2", "--optimizer.lr=0",
        "--lr_scheduler.warmup_steps=0", "--checkpoint.enable_checkpoint", "--checkpoint.model_weights_only",
        f"--checkpoint.initial_load_path={release}", "--checkpoint.initial_load_format=hf", timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    loss = float(re.search(r"step: 1 +loss: ([0-9.]+)", out.stderr).group(1))
    assert loss == pytest.approx(hf_loss(release, BATCH), abs=1e-4)  # the log prints 5 significant digits

    export, checkpoint = _export_script().main, str(dump / "checkpoint" / "step-1")
    for dtype, flag in ((torch.float32, []), (torch.bfloat16, ["--dtype", "bfloat16"])):
        exported = tmp_path / f"export-{dtype}"
        assert export([checkpoint, str(exported), "--format", "hf", *flag]) == 0, capsys.readouterr().err
        config = json.loads((exported / "config.json").read_text())
        assert config["tie_word_embeddings"] is True and config["torch_dtype"] == str(dtype)[6:]
        assert json.loads((exported / "generation_config.json").read_text()) == {"bos_token_id": 1,
                                                                                "eos_token_id": 2}
        names = {}
        for file in exported.glob("*.safetensors"):
            with safe_open(str(file), "pt") as f:
                names.update({n: f.get_slice(n).get_dtype() for n in f.keys()})
        assert "lm_head.weight" not in names and set(names.values()) == {"F32" if dtype == torch.float32 else "BF16"}
    # Default dtype: the release's (float32 here). transformers loads it tied, with the release's logits.
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / f"export-{torch.float32}").eval()
    assert theirs.lm_head.weight.data_ptr() == theirs.model.embed_tokens.weight.data_ptr()
    original = transformers.LlamaForCausalLM.from_pretrained(release).eval()
    assert theirs.num_parameters() == original.num_parameters()
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (theirs(tokens).logits - original(tokens).logits).abs().max().item()
    assert diff <= 1e-5, diff


LFS_POINTER = "version https://git-lfs.github.com/spec/v1\noid sha256:" + "0" * 64 + "\nsize 2471645608\n"


def _launch(*overrides: str) -> subprocess.CompletedProcess:
    env = torchrun_env(NGPU="2", CONFIG_FILE=DEBUG_TOML)
    return subprocess.run(["bash", str(REPO / "run_llama_train.sh"), *overrides], capture_output=True, text=True,
                          timeout=120, env=env)


@pytest.mark.slow
def test_bad_releases_through_the_launcher_exit_2_one_line_each(releases, tmp_path) -> None:
    import shutil

    mistral = write_json(tmp_path / "mistral", "config.json", {**PUBLISHED["3.1-8B"], "model_type": "mistral",
                                                                "architectures": ["MistralForCausalLM"]})
    tokenizer = tmp_path / "release" / "original" / "tokenizer.model"
    tokenizer.parent.mkdir(parents=True)
    tokenizer.write_text(LFS_POINTER)
    out = _launch(f"--model.flavor={mistral}", f"--model.tokenizer_path={tokenizer.parent.parent}",
                  f"--job.dump_folder={tmp_path / 'dump'}")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, out.stderr[-3000:]
    assert len(lines) == 2 and all(line.startswith("config error: ") for line in lines), out.stderr
    assert "architecture ['MistralForCausalLM'] is not supported" in lines[0]
    assert lines[1].endswith(f"{tokenizer} is a Git LFS pointer, not the file itself: run `git lfs pull` or "
                             "download it again")
    # Weights: a safetensors file that is a pointer, through the launcher; Meta's .pth in preflight's check.
    broken = tmp_path / "broken"
    shutil.copytree(releases["3.2-1B"], broken)
    (broken / "model.safetensors").write_text(LFS_POINTER)
    out = _launch(f"--model.flavor={broken}", f"--checkpoint.initial_load_path={broken}",
                  "--checkpoint.initial_load_format=hf", f"--job.dump_folder={tmp_path / 'dump'}")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    (line,) = out.stderr.strip().splitlines()
    assert line.endswith(f"{broken / 'model.safetensors'} is a Git LFS pointer, not the file itself: run "
                         "`git lfs pull` or download it again"), line
    meta = write_json(tmp_path / "meta", "params.json", {"dim": 256, "n_layers": 2, "n_heads": 32})
    (meta / "consolidated.00.pth").write_text(LFS_POINTER)
    (problem,) = check_source(str(meta), "meta", model_args("llama3", str(releases["3.2-1B"])))
    assert problem.endswith(f"{meta / 'consolidated.00.pth'} is a Git LFS pointer, not the file itself: run "
                            "`git lfs pull` or download it again"), problem
    assert not (tmp_path / "dump").exists()
