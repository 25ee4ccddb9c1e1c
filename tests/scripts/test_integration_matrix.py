"""tests/integration_tests.py without launching anything: the flavor definitions and the checks.

The matrix itself takes minutes (scripts/test.sh runs it after pytest); these tests take
well under a second and catch a misspelt override, a flavor whose expected mesh or
global batch does not follow from its own overrides, and checks that could never fail.
"""

from __future__ import annotations

import math

import pytest
from conftest import load_script

from torchtitan.config import ConfigManager
from torchtitan.distributed import ParallelDims

it = load_script("tests/integration_tests.py")

FLAVORS = it.build_flavors()
TRAINING = [(f, i, p) for f in FLAVORS if f.expect_error is None for i, p in enumerate(f.phases)]


def _cfg(phase):
    return ConfigManager().parse_args(["--job.config_file", str(it.CI_CONFIG), *phase.overrides])


@pytest.mark.parametrize("flavor,index,phase", TRAINING, ids=[f"{f.name}-{i + 1}" for f, i, _ in TRAINING])
def test_training_phase_parses_and_matches_its_mesh_and_batch(flavor, index, phase):
    cfg = _cfg(phase)  # raises on a misspelt option or a bad value
    if phase.mesh is None:
        return
    dims = ParallelDims.from_config(cfg.parallelism, phase.ranks)
    assert [(d, dims.degree(d)) for d in dims.enabled_dims] == list(phase.mesh)
    assert dims.degree("dp") == (phase.dp or phase.ranks)
    accum = cfg.training.gradient_accumulation_steps
    assert accum == phase.accum
    # Every training flavor trains on the control's global batch: its step-1 loss is comparable.
    assert phase.local_batch() * dims.degree("dp") * accum == it.GLOBAL_BATCH


def test_every_issue_flavor_is_defined_and_the_control_is_fsdp_on_8():
    names = {f.name for f in FLAVORS}
    assert {"fsdp", "hsdp", "ddp", "fsdp_full_ac", "fsdp_compile", "grad_accum", "multinode", "tensorboard",
            "profiling", "hsdp_tp", "fsdp_tp_cp", "pp_1f1b", "pp_gpipe", "pp_interleaved_1f1b", "pp_tp_fsdp",
            "ckpt_resume", "ckpt_reshard", "seed_ckpt"} <= names
    assert sum(f.expect_error is not None for f in FLAVORS) >= 2
    control = next(f for f in FLAVORS if f.name == it.CONTROL)
    assert control.ranks == 8 and control.phases[0].mesh == (("dp_shard", 8),)


def test_select_rejects_unknown_names_and_honours_exclude():
    assert [f.name for f in it.select(FLAVORS, "hsdp,ddp", "ddp")] == ["hsdp"]
    with pytest.raises(SystemExit, match="unknown flavor"):
        it.select(FLAVORS, "hsdp,nope", None)


# ---- the checks, on synthetic runs ------------------------------------------------------
def _run(tmp_path, log: str, losses: dict[int, float], rc: int = 0, mesh=(("dp_shard", 2),), **phase_kw):
    (tmp_path / "config.toml").write_text("[training]\nsteps = 6\n")
    phase = it.Phase(("--x",), 2, mesh=mesh, **phase_kw)
    return it.Run(phase, rc, 1.0, log, tmp_path, losses)


MESH_LOG = "[rank0] 00:00:00 INFO World mesh {'dp_shard': 2}\n"
FALLING = {s: 8.0 - 0.2 * s for s in range(1, 7)}


def test_check_run_accepts_a_good_run(tmp_path):
    assert it.check_run(_run(tmp_path, MESH_LOG, FALLING), None) == []


@pytest.mark.parametrize("log,losses,kw,expected", [
    (MESH_LOG, {s: 8.0 for s in range(1, 7)}, {}, "does not fall"),
    (MESH_LOG, {**FALLING, 6: math.nan}, {}, "non-finite"),
    (MESH_LOG, {s: FALLING[s] for s in range(1, 6)}, {}, "expected [1, 2, 3, 4, 5, 6]"),
    ("[rank0] 00:00:00 INFO World mesh {'dp_replicate': 2}\n", FALLING, {}, "!= expected"),
    ("", FALLING, {}, "no 'World mesh' line"),
    (MESH_LOG, FALLING, {"rc": 1}, "exit status 1"),
])
def test_check_run_catches(tmp_path, log, losses, kw, expected):
    problems = it.check_run(_run(tmp_path, log, losses, **kw), None)
    assert any(expected in p for p in problems), problems


# Warning lines a Qwen3-MoE FSDP 2 x EP 2 run printed before they were fixed (issue 50), and the project's own.
WARNINGS = [
    "/site-packages/torch/distributed/fsdp/_fully_shard/_fsdp_state.py:331: UserWarning: FSDP2-wrapped module "
    "(FSDPGroupedExperts) returned a view tensor. An in-place op on this view ...",
    "/work/torchtitan/compat.py:92: UserWarning: Set timeout is now only supported for either nccl or gloo.",
    "[rank1]:W1127 18:25:55.355000 10285 site-packages/torch/distributed/tensor/_redistribute.py:390] While "
    "redistributing from (_NormPartial(2.0), _NormPartial(2.0)) to (Replicate(), Replicate()), 2 sequential ...",
    "W1127 18:26:12.491000 11090 site-packages/torch/distributed/run.py:874] Setting OMP_NUM_THREADS ...",
    "[rank0] 18:28:30 WARNING Shutdown: not every rank finished within 120 s",
]


@pytest.mark.parametrize("line", WARNINGS)
def test_no_warnings_check_catches_each_kind_of_warning(tmp_path, line):
    clean = MESH_LOG + "[rank0] 18:25:56 INFO step: 1  loss: 8.1673  grad_norm: 1.6191\n"
    assert it._no_warnings([_run(tmp_path, clean, FALLING)]) == []
    problems = it._no_warnings([_run(tmp_path, clean + line + "\n", FALLING)])
    assert problems and line[:40] in problems[0], problems


def test_a_resumed_phase_starts_later_and_need_not_fall(tmp_path):
    resumed = {s: 7.0 for s in range(4, 7)}
    assert it.check_run(_run(tmp_path, MESH_LOG, resumed, first_step=4, falls=False), None) == []
    restarted = _run(tmp_path, MESH_LOG, {s: 7.0 for s in range(1, 7)}, first_step=4, falls=False)
    assert any("expected [4, 5, 6]" in p for p in it.check_run(restarted, None))


def test_compare_curves_is_exact_at_zero_tolerance(tmp_path):
    a = _run(tmp_path, MESH_LOG, FALLING)
    b = _run(tmp_path, MESH_LOG, {s: v for s, v in FALLING.items() if s >= 4})
    assert it.compare_curves(a, b, 0.0) == []
    b.losses[5] = math.nextafter(b.losses[5], 0.0)
    assert "step 5" in it.compare_curves(a, b, 0.0)[0]


BAD_FLAVOR = it.Flavor("bad", "", (it.Phase(("--x",), 2),), parity_phase=None, expect_error=r"config error: boom")
TORCHRUN_TAIL = ("Traceback (most recent call last):\n  File \"/usr/lib/python3/site-packages/torch/run.py\"\n"
                 "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
                 "  exitcode  : 2 (pid: 1)\n  exitcode  : -15 (pid: 2)  (SIGTERM)\n")


def test_bad_config_passes_on_a_clean_config_error(tmp_path):
    run = _run(tmp_path, "config error: boom\n" + TORCHRUN_TAIL, {}, rc=1)
    assert it.check_bad_config(BAD_FLAVOR, run, 60) == []


@pytest.mark.parametrize("log,rc,expected", [
    ("config error: other\n" + TORCHRUN_TAIL, 1, "no line matches"),
    ("config error: boom\n" + TORCHRUN_TAIL.replace("exitcode  : 2", "exitcode  : 1"), 1, "no rank exited with 2"),
    ("config error: boom\n  File \"/work/torchtitan/trainer.py\", line 1\n" + TORCHRUN_TAIL, 1, "traceback"),
    ("config error: boom\n[rank0] 00:00:00 INFO step: 1  loss: 8.0\n" + TORCHRUN_TAIL, 1, "training started"),
    ("config error: boom\n", 124, "did not exit"),
])
def test_bad_config_catches(tmp_path, log, rc, expected):
    problems = it.check_bad_config(BAD_FLAVOR, _run(tmp_path, log, {}, rc=rc), 60)
    assert any(expected in p for p in problems), problems
