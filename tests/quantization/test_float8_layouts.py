"""Float8 in every layout: the one-process model, trained alike; checkpoints that do not care about precision.

Debug model, float32 on CPU/gloo, deterministic, a global batch of 4 sequences in every layout, 4 steps.
Three launches (1, 2 and 4 ranks) train their layouts one after another in one process group
each (tests/distributed/layout_entry.py). Every layout must start from bitwise the one-process model
and track the one-process Float8 run's losses within ``FP8_LAYOUT_BOUND`` (why that bound: below).
Checkpoints resume across precisions; the FSDP FP8-all-gather one holds no torchao class and resumes
with precomputed scales bitwise.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import DEBUG_CONFIG

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from layout_entry import launch  # noqa: E402

pytestmark = pytest.mark.slow  # every test here starts processes

STEPS = 4
ENTRY = Path(__file__).with_name("float8_entry.py")
COMMON = [f"--job.config_file={DEBUG_CONFIG}", f"--training.steps={STEPS}", "--training.deterministic",
          "--metrics.log_freq=1000", "--job.print_args=false", "--metrics.enable_tensorboard=false"]
FP8 = "--model.converters=float8"
ALL_GATHER = ["--float8.enable_fsdp_float8_all_gather", "--float8.precompute_float8_dynamic_scale_for_fsdp"]
SAVE = ["--checkpoint.enable_checkpoint", "--checkpoint.interval=2"]
# Scales are amaxes over whole tensors (a DTensor's is reduced over its mesh), so every layout casts with
# the one-process scales; what differs is float32 rounding where a layout sums in another order (reduce-
# scatters, TP's partial sums, micro-batches under PP). Such a difference moves a value across an FP8
# rounding boundary now and then (a relative change of up to 2^-4 on that element), so layouts agree less
# tightly than high-precision ones (1e-4 there). Measured over these 4 steps: at most 4.5e-5 (PP 2), about
# what FP8 itself moves the loss from high precision here (4.4e-5: at initialization the loss hardly
# depends on small logit errors). The bound is ten times the largest measured difference.
FP8_LAYOUT_BOUND = 5e-4
FP8_VS_HIGH_PRECISION = 5e-3  # Float8 against high precision over 4 steps (4.4e-5 measured; 7.5e-5 after a resume)


def _dp(replicate: int, shard: int) -> list[str]:
    return [f"--parallelism.data_parallel_replicate_degree={replicate}",
            f"--parallelism.data_parallel_shard_degree={shard}", f"--training.batch_size={4 // (replicate * shard)}"]


ONE = _dp(1, 1)
FSDP_ALL_GATHER = "FSDP 2 (FP8 all-gather)"
LAYOUTS_2 = {
    FSDP_ALL_GATHER: [FP8, *_dp(1, 2), *ALL_GATHER, *SAVE],
    "FSDP 2 rowwise + AC": [FP8, *_dp(1, 2), "--float8.recipe_name=rowwise", "--activation_checkpoint.mode=full"],
    "TP 2 (FP8 styles)": [FP8, *ONE, "--parallelism.tensor_parallel_degree=2"],
    "PP 2": [FP8, *ONE, "--parallelism.pipeline_parallel_degree=2"],
    "CP 2": [FP8, *ONE, "--parallelism.context_parallel_degree=2"],
}
LAYOUTS_4 = {"HSDP 2x2 (FP8 all-gather)": [FP8, *_dp(2, 2), *ALL_GATHER]}
# Resumed from FSDP_ALL_GATHER's step-2 checkpoint in the same launch, after it: with the FP8 all-gather and
# precomputed scales (bitwise that run's steps 3-4), and in high precision (the weights loaded bitwise).
RESUMED_ALL_GATHER = "FSDP 2 (FP8 all-gather) resumed"
RESUMED_HIGH_PRECISION = "FSDP 2 high precision resumed from the FP8 all-gather"
RESUMES_2 = {RESUMED_ALL_GATHER: [FP8, *_dp(1, 2), *ALL_GATHER, *SAVE], RESUMED_HIGH_PRECISION: [*_dp(1, 2), *SAVE]}
ROWWISE_CONTROL = "one process rowwise"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    one = {
        "high precision": {"overrides": [*ONE, *SAVE]},
        "one process": {"overrides": [FP8, *ONE, *SAVE]},
        ROWWISE_CONTROL: {"overrides": [FP8, *ONE, "--float8.recipe_name=rowwise"]},
        "Float8 resumed from high precision": {"overrides": [FP8, *ONE, *SAVE], "resume": "high precision"},
        "high precision resumed from Float8": {"overrides": [*ONE, *SAVE], "resume": "one process"},
    }
    env = {"OMP_NUM_THREADS": "1"}
    out = launch(ENTRY, tmp_path_factory.mktemp("fp8_one"), COMMON, one, nproc=1, timeout=900, env=env)
    resumes = {name: {"overrides": o, "resume": FSDP_ALL_GATHER} for name, o in RESUMES_2.items()}
    for layouts, nproc in ((LAYOUTS_2, 2), (LAYOUTS_4, 4)):
        spec = {name: {"overrides": o} for name, o in layouts.items()} | (resumes if nproc == 2 else {})
        out.update(launch(ENTRY, tmp_path_factory.mktemp(f"fp8_{nproc}"), COMMON, spec, nproc=nproc, timeout=1800,
                          env=env))
    return out


def _rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == STEPS, (a, b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_one_process_float8_converts_and_differs_from_high_precision(runs):
    fp8, hp = runs["one process"], runs["high precision"]
    assert "Float8Linear" in fp8["classes"] and "Float8Linear" not in hp["classes"]
    assert fp8["init"] == hp["init"]  # the converter keeps every parameter's values
    rel = _rel(fp8["losses"], hp["losses"])
    print(f"\nFloat8 vs high precision, one process: max rel loss difference over {STEPS} steps {rel:.2e}")
    assert 0 < rel <= FP8_VS_HIGH_PRECISION  # FP8 products really ran, and train the same model
    assert fp8["losses"][-1] < fp8["losses"][0]


@pytest.mark.parametrize("name", [*LAYOUTS_2, *LAYOUTS_4])
def test_layout_tracks_the_one_process_float8_run(name, runs):
    run = runs[name]
    control = runs[ROWWISE_CONTROL if "rowwise" in name else "one process"]
    if "PP" not in name:  # a stage holds part of the model; its init is test_pipeline_parallel.py's
        assert run["init"] == control["init"], name
    assert "Float8Linear" in run["classes"]
    rel = _rel(run["losses"], control["losses"])
    print(f"\n{name}: max rel loss difference to one process over {STEPS} steps {rel:.2e}")
    assert rel <= FP8_LAYOUT_BOUND, (name, rel)


@pytest.mark.parametrize("name", [*LAYOUTS_2, *LAYOUTS_4])
def test_fp8_all_gather_wraps_every_converted_weight_where_asked(name, runs):
    # FSDP gathers a weight in FP8 when it is torchao's cast-on-gather tensor: all 42 converted ones, or none.
    assert runs[name]["fp8_gathered_weights"] == (42 if "FP8 all-gather" in name else 0), name


@pytest.mark.parametrize(("resumed", "source"), [("Float8 resumed from high precision", "high precision"),
                                                 ("high precision resumed from Float8", "one process")])
def test_checkpoint_resumes_across_precisions(resumed, source, runs):
    run, src = runs[resumed], runs[source]
    # The weights loaded are bitwise those the other precision saved at step 2 ...
    assert run["first_step"] == src["after_resume_step"], resumed
    assert len(run["losses"]) == STEPS - 2
    # ... and the two steps after the resume track the source's own steps 3 and 4 within FP8's error.
    rel = max(abs(a - b) / b for a, b in zip(run["losses"], src["losses"][2:]))
    print(f"\n{resumed}: steps 3-4 rel to {source}'s {rel:.2e}")
    assert 0 < rel <= FP8_VS_HIGH_PRECISION


def test_fp8_all_gather_resume_with_precomputed_scales_is_bitwise(runs):
    # The resumed run's first all-gather casts with the loaded weights' scales, as the run that went on did.
    run, src = runs[RESUMED_ALL_GATHER], runs[FSDP_ALL_GATHER]
    assert run["first_step"] == src["after_resume_step"]
    assert run["losses"] == src["losses"][2:]


def test_fp8_all_gather_checkpoint_holds_no_float8_class_and_loads_in_high_precision(runs):
    src = runs[FSDP_ALL_GATHER]
    files = [f for f in (Path(src["dump"]) / "checkpoint" / "step-2").rglob("*") if f.is_file()]
    assert files
    # A pickled torchao class would make a process without torchao (or Float8) refuse the checkpoint.
    holding = [f.name for f in files if b"torchao" in f.read_bytes()]
    assert not holding, holding
    assert runs[RESUMED_HIGH_PRECISION]["first_step"] == src["after_resume_step"]
