"""A mixture run through train.py under torchrun: FSDP 2 saves, one process resumes and matches the straight run.

Also through the commands users type: the mixture comes from ``[[training.dataset_mix]]`` tables,
the step line carries the tokens per source, validation reports the loss per held-out source, a
resume with other weights is refused in one line, and with ``--training.dataset_mix_new_phase``
starts a new phase at the resumed step.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, torchrun_env

pytestmark = pytest.mark.slow
DEBUG = REPO / "train_configs" / "debug_model.toml"
STEP_LINE = re.compile(r"step: (\d+)  loss: ([0-9.e+-]+)")


def _corpus(path: Path, words: list[str], n: int) -> Path:
    docs = [" ".join(words[(i * 3 + j) % len(words)] for j in range(6 + i % 13)) + f" {i}." for i in range(n)]
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def _config(tmp: Path, weights: tuple[float, float]) -> Path:
    web = _corpus(tmp / "web.jsonl", "alpha beta gamma delta epsilon zeta eta theta iota kappa".split(), 400)
    code = _corpus(tmp / "code.jsonl", "def return class import lambda yield while for".split(), 300)
    text = DEBUG.read_text() + "".join(
        f'\n[[training.dataset_mix]]\npath = "{p}"\nweight = {w}\n' for p, w in ((web, weights[0]), (code, weights[1])))
    out = tmp / f"mix_{weights[0]}.toml"
    out.write_text(text)
    return out


def _run(dump: Path, config: Path, ranks: int, *overrides: str) -> subprocess.CompletedProcess:
    env = torchrun_env(OMP_NUM_THREADS="1")
    args = ["--job.config_file", str(config), f"--job.dump_folder={dump}", "--job.print_args=false",
            "--metrics.enable_tensorboard=false", "--training.deterministic", "--training.steps=6",
            "--checkpoint.enable_checkpoint", "--checkpoint.interval=3", "--validation.enable",
            "--validation.held_out_fraction=0.2", "--validation.freq=3", *overrides]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                "--monitor-interval=0.1"]
    return subprocess.run([*launcher, str(REPO / "train.py"), *args], capture_output=True, text=True, timeout=400,
                          env=env, cwd=REPO)


def _losses(out: subprocess.CompletedProcess) -> dict[int, float]:
    return {int(m[1]): float(m[2]) for m in STEP_LINE.finditer(out.stdout + out.stderr)}


def test_fsdp2_mixture_resumes_in_one_process_and_matches_the_straight_run(tmp_path):
    config = _config(tmp_path, (0.7, 0.3))
    straight = _run(tmp_path / "fsdp2", config, 2, "--training.batch_size=2")
    log = straight.stdout + straight.stderr
    assert straight.returncode == 0, log[-4000:]
    assert re.search(r"step: 6 .*  mix: web \S+ code \S+", log), log[-3000:]
    assert re.search(r"validation step: 3 .*per source: web \S+ \(bpb \S+\) code \S+ \(bpb \S+\)", log), log[-3000:]

    target = tmp_path / "one"
    shutil.copytree(tmp_path / "fsdp2" / "checkpoint" / "step-3", target / "checkpoint" / "step-3")
    resumed = _run(target, config, 1, "--training.batch_size=4")  # the same global batch of 4 windows
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
    want, got = _losses(straight), _losses(resumed)
    assert sorted(got) == [4, 5, 6], got
    assert abs(got[4] - want[4]) <= 1e-5 * abs(want[4]), (got, want)
    for step in (5, 6):
        assert abs(got[step] - want[step]) <= 1e-4 * abs(want[step]), (got, want)

    other = tmp_path / "other"
    shutil.copytree(tmp_path / "fsdp2" / "checkpoint" / "step-3", other / "checkpoint" / "step-3")
    refused = _run(other, _config(tmp_path, (0.5, 0.5)), 1, "--training.batch_size=4")
    assert refused.returncode != 0 and "exitcode  : 2" in refused.stderr, refused.stderr[-3000:]  # a config error
    errors = [line for line in refused.stderr.splitlines() if line.startswith("config error:")]
    assert len(errors) == 1 and "web:0.7, code:0.3" in errors[0] and "web:0.5, code:0.5" in errors[0]
    assert "--training.dataset_mix_new_phase" in errors[0] and "Training failed" not in refused.stderr

    # Asked for, the new mixture starts a phase at the resumed step (3 steps x 4 windows = sample 12); the
    # tokens per source go on from the checkpoint's (web 9 and code 3 windows of 64, then 6 and 6).
    annealed = _run(other, tmp_path / "mix_0.5.toml", 1, "--training.batch_size=4",
                    "--training.dataset_mix_new_phase")
    log = annealed.stdout + annealed.stderr
    assert annealed.returncode == 0, log[-4000:]
    assert "new phase at sample 12 (the checkpoint's mixture was web:0.7, code:0.3)" in log, log[-3000:]
    assert re.search(r"step: 6 .*  mix: web 960 code 576", log), log[-3000:]
