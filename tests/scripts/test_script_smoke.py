"""Every script under scripts/ has a smoke run in the suite (tests/script_smoke.py says what each kind checks).

Most are run by the tests of what they do (``elsewhere``); the shell scripts that install, run the suite or
need a cluster are parsed; a script whose smallest run starts several ranks is argument-parsed; the tokenizer
trainer runs here, in this process.
"""

from __future__ import annotations

import subprocess

import pytest
from conftest import REPO
from script_smoke import Run, Smoke, call_main, coverage_problems, load, named_paths, run_key

RANKS = "its smallest run starts torchrun ranks (10 s of CPU or more)"
WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa")
# A corpus of a few distinct characters: the smallest vocabulary (300) leaves room for merges.
CORPUS = "\n".join(" ".join(WORDS[(i * j) % len(WORDS)] for j in range(12)) for i in range(40))

TABLE: dict[str, Smoke] = {
    "scripts/check_parity.py": Smoke(help=True, why=RANKS),
    "scripts/create_seed_checkpoint.sh": Smoke(elsewhere="tests/checkpoint/test_seed_and_reshard.py"),
    "scripts/export_checkpoint.py": Smoke(elsewhere="tests/scripts/test_export_routing_bias.py"),
    "scripts/generate.py": Smoke(elsewhere="tests/generation/test_generate.py"),
    "scripts/install.sh": Smoke(elsewhere="tests/scripts/test_install.py"),
    "scripts/loss_compare.py": Smoke(elsewhere="tests/scripts/test_loss_compare.py"),
    "scripts/loss_fingerprint.py": Smoke(help=True, elsewhere="tests/scripts/test_loss_fingerprint.py", why=RANKS),
    "scripts/multinode_trainer.slurm": Smoke(bash=True, why="needs a Slurm cluster"),
    "scripts/plan.py": Smoke(elsewhere="tests/planning/test_plan.py"),
    "scripts/prepare_data.py": Smoke(elsewhere="tests/datasets/test_token_store.py"),
    "scripts/stress_exit.py": Smoke(help=True, elsewhere="tests/test_faults.py"),
    "scripts/test.sh": Smoke(bash=True, why="it is CI: the whole suite"),
    "scripts/test_torch.sh": Smoke(bash=True, why="installs another torch into a virtual environment"),
    "scripts/train_debug.sh": Smoke(bash=True, why="installs, then trains through run_llama_train.sh "
                                                   "(tests/scripts/test_launcher.py runs the launcher)"),
    "scripts/train_tokenizer.py": Smoke(runs=(Run(("--vocab-size", "300", "--input", "{tmp}/corpus.txt", "--output",
                                                   "{tmp}/tokenizer.model"), "vocab 300",
                                                  files=(("corpus.txt", CORPUS),)),)),
}
RUNS = [(path, run) for path, smoke in TABLE.items() for run in smoke.runs]
SHELL = [path for path, smoke in TABLE.items() if smoke.bash]


def test_every_script_has_a_smoke_entry():
    assert coverage_problems("scripts", TABLE) == []


@pytest.mark.parametrize("path", [p for p, s in TABLE.items() if s.help])
def test_help(path, capsys):
    assert call_main(load(path), ["--help"]) == 0
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("path", SHELL)
def test_shell_script_names_only_existing_files(path):
    missing = [name for name in named_paths(path) if not (REPO / name).exists()]
    assert missing == [], f"{path} names files that do not exist: {missing}"


@pytest.mark.slow  # bash, once for every shell script here and under benchmarks/
def test_shell_scripts_parse():
    from script_smoke import scripts_under

    shell = [p for p in scripts_under("scripts") + scripts_under("benchmarks") if not p.endswith(".py")]
    loop = 'for f in "$@"; do bash -n "$f" || echo "does not parse: $f"; done'
    out = subprocess.run(["bash", "-c", loop, "bash", *shell], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.stdout == "" and out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("path, run", RUNS, ids=[run_key(p, r) for p, r in RUNS])
def test_tiny_run(path, run, tmp_path, capsys):
    # In this process: the tokenizer trainer sets no torch state (threads, generators, process groups), and a
    # process of its own would cost a torch import for a run of a tenth of a second.
    for name, text in run.files:
        (tmp_path / name).write_text(text)
    assert call_main(load(path), [a.replace("{tmp}", str(tmp_path)) for a in run.argv]) == 0
    assert run.expect in capsys.readouterr().out


def test_train_tokenizer_names_the_vocab_size_a_corpus_needs(tmp_path, capsys):
    """Too small a vocabulary for the corpus's characters is one line naming the option and the size it needs,
    not SentencePiece's C++ assertion."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(chr(0x4E00 + i) * 3 for i in range(120)), encoding="utf-8")  # 120 characters
    status = call_main(load("scripts/train_tokenizer.py"),
                       ["--vocab-size", "300", "--input", str(corpus), "--output", str(tmp_path / "t.model")])
    assert status == 2
    err = capsys.readouterr().err
    assert "--vocab-size 300 is too small" in err and "give --vocab-size >= " in err, err
