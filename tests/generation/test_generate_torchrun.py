"""Generation from a checkpoint of a short FSDP training run: on one process (DCP reshards it) and under
``torchrun`` with tensor parallelism over 2 ranks, through ``scripts/generate.py``; both give the same
greedy tokens. A tokenizer that does not fit the checkpoint's vocabulary is refused in one line."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, SHIPPED_TOKENIZER, torchrun_env

from torchtitan.datasets.tokenizer import build_tokenizer

pytestmark = pytest.mark.slow  # starts torchrun

DEBUG_TOML = str(REPO / "train_configs" / "debug_model.toml")
PROMPTS = ["Once upon a time", "The little dog"]


def _torchrun(*argv: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = torchrun_env(OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           *argv], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """The dump folder of a 2-step FSDP 2 run of the debug model that saved its last step."""
    dump = tmp_path_factory.mktemp("generate_run")
    out = _torchrun(str(REPO / "train.py"), "--job.config_file", DEBUG_TOML, f"--job.dump_folder={dump}",
                    "--metrics.enable_tensorboard=false", "--training.seq_len=32", "--training.steps=2",
                    "--parallelism.data_parallel_shard_degree=2", "--checkpoint.enable_checkpoint")
    assert out.returncode == 0, out.stderr[-3000:]
    assert (dump / "checkpoint" / "step-2" / ".metadata").is_file() and (dump / "config.toml").is_file()
    return dump


def _script():
    spec = importlib.util.spec_from_file_location("generate_script", REPO / "scripts" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _small_hf_tokenizer(folder: Path) -> Path:
    """A Hugging Face tokenizer of 6 words: not the vocabulary the run trained with."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir()
    tok = Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "<unk>": 2, "the": 3, "dog": 4, "a": 5}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return folder


def test_one_process_and_tp2_generate_the_same_from_an_fsdp_checkpoint(trained, tmp_path, capsys) -> None:
    prompt_args = [a for p in PROMPTS for a in ("--prompt", p)]
    # One process: the checkpoint folder (its latest step), the run's config.toml found above it.
    assert _script().main([str(trained / "checkpoint"), *prompt_args, "--max_new_tokens", "8", "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert alone["tensor_parallel"] == 1 and alone["dtype"] == "float32"
    eos = build_tokenizer(SHIPPED_TOKENIZER).eos_id  # the run's tokenizer
    assert all(len(o["tokens"]) == 8 or o["tokens"][-1] == eos for o in alone["outputs"])
    out = _torchrun(str(REPO / "scripts" / "generate.py"), str(trained / "checkpoint" / "step-2"), *prompt_args,
                    "--max_new_tokens", "8", "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    (line,) = out.stdout.splitlines()  # rank 0 prints, once
    tp = json.loads(line)
    assert tp["tensor_parallel"] == 2
    for a, b in zip(alone["outputs"], tp["outputs"]):
        assert (a["prompt_tokens"], a["tokens"], a["text"]) == (b["prompt_tokens"], b["tokens"], b["text"])

    # A tokenizer whose vocabulary is not the checkpoint's.
    small = _small_hf_tokenizer(tmp_path / "small_tok")
    assert _script().main([str(trained / "checkpoint"), "--prompt", "the dog", "--tokenizer", str(small)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "(6 tokens) does not match the vocabulary of" in err, err
