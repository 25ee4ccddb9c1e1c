"""Muon through the trainer in every layout: the one-process update, each matrix orthogonalized by one rank,
and its state resumed on another layout (docs/optimizers.md, "Distributed" and "Checkpoints").

The Llama 3 debug model's shape with 2 blocks (FSDP 2, TP 2, PP 2, HSDP 2x2) trains 6 steps of Muon, and the
DeepSeek-V3 debug model (MLA, 8 experts; EP 2 x FSDP 2) 6 steps of MuonClip, its QK-clip threshold low enough that
heads are clipped at every step; all with the float32 iteration, float32 on CPU/gloo, ``training.deterministic``, a
global batch of 4 sequences of 32 tokens everywhere. Three launches (tests/distributed/layout_entry.py): 2 ranks
(FSDP 2, which saves step 3, TP 2, PP 2), then 1 rank (the one-process controls, and FSDP 2's step 3 resumed)
and 4 ranks (HSDP 2x2, EP 2 x FSDP 2, and FSDP 2's step 3 resumed). Each layout's step-1 loss is within 1e-5
and its 6 losses within 1e-4 (relative) of one process's, and each parameter moved by training (final -
initial, gathered whole) as in one process: the norm of the difference of the two movements within 1e-4 of
the norm of one process's movement. At every step the ranks together orthogonalize each of the model's
matrices exactly once (counted in ``newton_schulz``, by shape), and a resume on another layout continues the
uninterrupted FSDP 2 run within 1e-5. (The same-layout resume is bitwise: tests/checkpoint/test_resume.py.)
MuonClip clips the same number of heads as in one process at every step, its logged max logit within 1e-4.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import DEBUG_CONFIG, REPO

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from layout_entry import launch  # noqa: E402

pytestmark = pytest.mark.slow  # every test here starts processes

STEPS, SEQ, SAVE_STEP = 6, 32, 3  # SAVE_STEP: muon_layouts_entry.RESUME_STEP
ENTRY = Path(__file__).with_name("muon_layouts_entry.py")
COMMON = [f"--training.steps={STEPS}", f"--training.seq_len={SEQ}", "--training.deterministic",
          "--training.mixed_precision_param=float32", "--job.print_args=false", "--metrics.enable_tensorboard=false",
          f"--metrics.log_freq={STEPS}", "--optimizer.name=Muon", "--optimizer.muon_ns_dtype=float32"]
SAVE = ["--checkpoint.enable_checkpoint", f"--checkpoint.interval={SAVE_STEP}"]
# QK-clip on the DeepSeek-V3 runs, its log read back from TensorBoard every step: the debug model's largest
# logit is about 0.2 at the start, so this threshold clips heads at every step
QK_CLIP_THRESHOLD = 0.1
MUON_CLIP = ["--optimizer.name=MuonClip", f"--optimizer.qk_clip_threshold={QK_CLIP_THRESHOLD}",
             "--metrics.enable_tensorboard=true", "--metrics.log_freq=1"]
LLAMA_BLOCKS = 2  # the Llama 3 debug model's shape with 2 blocks: Newton-Schulz is most of a step's time on CPU


def _dims(shard: int = 1, replicate: int = 1, **more: int) -> list[str]:
    """A layout's degrees, with the per-rank batch that keeps the global batch at 4."""
    names = {"tp": "tensor_parallel_degree", "pp": "pipeline_parallel_degree", "ep": "expert_parallel_degree"}
    return [f"--parallelism.data_parallel_shard_degree={shard}",
            f"--parallelism.data_parallel_replicate_degree={replicate}",
            f"--training.batch_size={4 // (shard * replicate)}",
            *(f"--parallelism.{names[k]}={v}" for k, v in more.items())]


# name -> (model, overrides); the models' overrides are the fixture's
ONE, ONE_DSV3 = "one process", "one process, DeepSeek-V3, MuonClip"
SOURCE = "FSDP 2"  # saves step SAVE_STEP, resumed on other layouts
LAYOUTS_2 = {
    SOURCE: ("llama", [*_dims(shard=2), *SAVE]),
    "TP 2": ("llama", _dims(tp=2)),
    "PP 2": ("llama", [*_dims(pp=2), "--parallelism.pipeline_parallel_schedule=1F1B",
                       "--parallelism.pipeline_parallel_microbatches=2"]),
}
LAYOUTS_4 = {
    "HSDP 2x2": ("llama", _dims(shard=2, replicate=2)),
    # dense weights FSDP over 4 ranks; the experts over 2 EP ranks x 2 FSDP ranks
    "EP 2 x FSDP 2, DeepSeek-V3, MuonClip": ("dsv3", _dims(shard=4, ep=2)),
}
CONTROLS = {ONE: ("llama", _dims()), ONE_DSV3: ("dsv3", _dims())}
RESUMED = {"one process": _dims(), "HSDP 2x2": _dims(shard=2, replicate=2)}  # resumed from SOURCE's step SAVE_STEP


@pytest.fixture(scope="module")
def runs(tmp_path_factory, debug_blocks) -> dict:
    models = {"llama": [f"--job.config_file={DEBUG_CONFIG}", f"--model.flavor={debug_blocks(LLAMA_BLOCKS)}"],
              "dsv3": [f"--job.config_file={REPO / 'train_configs' / 'deepseek_v3_debug.toml'}", *MUON_CLIP]}

    def spec(layouts: dict[str, tuple[str, list[str]]]) -> dict[str, dict]:
        return {name: {"overrides": [*models[model], *o]} for name, (model, o) in layouts.items()}

    env = {"OMP_NUM_THREADS": "1"}
    root_2 = tmp_path_factory.mktemp("muon_2")
    out = launch(ENTRY, root_2, COMMON, spec(LAYOUTS_2), nproc=2, timeout=900, env=env)
    source_dump = root_2 / f"run{list(LAYOUTS_2).index(SOURCE)}"  # layout_entry's dump folders
    for nproc, layouts, resumed in ((1, CONTROLS, "one process"), (4, LAYOUTS_4, "HSDP 2x2")):
        layouts_and_resume = spec(layouts)
        layouts_and_resume[f"{resumed}, resumed from {SOURCE}"] = {
            "overrides": [*models["llama"], *RESUMED[resumed], "--checkpoint.enable_checkpoint"], "resume": SOURCE,
            "resume_dump": str(source_dump)}
        out.update(launch(ENTRY, tmp_path_factory.mktemp(f"muon_{nproc}"), COMMON, layouts_and_resume, nproc=nproc,
                          timeout=900, env=env))
    return out


def _rel(a: list[float], b: list[float]) -> list[float]:
    assert len(a) == len(b), (a, b)
    return [abs(x - y) / abs(y) for x, y in zip(a, b)]


def _control(name: str) -> str:
    return ONE_DSV3 if "DeepSeek" in name else ONE


@pytest.mark.parametrize("name", [*LAYOUTS_2, *LAYOUTS_4])
def test_layout_trains_the_one_process_model(name, runs):
    run, control = runs[name], runs[_control(name)]
    rel = _rel(run["losses"], control["losses"])
    assert len(rel) == STEPS
    moved, want = torch.load(run["moved"]), torch.load(control["moved"])
    assert moved.keys() == want.keys(), name
    # each parameter: |final - initial| here against one process's, relative to the norm of one process's
    off = {fqn: float((moved[fqn] - want[fqn]).norm() / want[fqn].norm()) for fqn in want}
    worst = max(off, key=off.__getitem__)
    print(f"\n{name}: step-1 rel {rel[0]:.1e}, max rel over {STEPS} steps {max(rel):.1e}; "
          f"movement off by {off[worst]:.1e} at most ({worst})")
    assert rel[0] <= 1e-5 and max(rel) <= 1e-4, (name, rel)
    assert all(want[fqn].norm() > 0 for fqn in want), "every parameter trains"
    assert off[worst] <= 1e-4, (name, sorted(off.items(), key=lambda kv: -kv[1])[:3])
    assert control["losses"][-1] < control["losses"][0]  # and the model learns


@pytest.mark.parametrize("name", [*CONTROLS, *LAYOUTS_2, *LAYOUTS_4])
def test_each_matrix_is_orthogonalized_once_a_step(name, runs):
    """Summed over the ranks, each step's Newton-Schulz calls cover the model's matrices exactly once: a matrix
    orthogonalized on two ranks (an owner per replica, or every rank of its mesh) counts twice."""
    run = runs[name]
    assert run["matrices"], name
    assert run["orthogonalized"] == [run["matrices"]] * STEPS, (name, run["matrices"], run["orthogonalized"])


@pytest.mark.parametrize("layout", list(RESUMED))
def test_fsdp2_checkpoint_resumes_on_another_layout(layout, runs):
    """The Muon state (a momentum per matrix, sharded like it; AdamW's moments for the rest) saved by FSDP 2 at
    step 3 continues that run on another layout: steps 4-6 within 1e-5 of the uninterrupted run's."""
    resumed, straight = runs[f"{layout}, resumed from {SOURCE}"]["losses"], runs[SOURCE]["losses"][SAVE_STEP:]
    rel = _rel(resumed, straight)
    print(f"\n{layout} resumed from {SOURCE}: max rel over steps {SAVE_STEP + 1}-{STEPS} {max(rel):.1e}")
    assert len(resumed) == STEPS - SAVE_STEP and max(rel) <= 1e-5, (layout, resumed, straight)


def test_muonclip_clips_heads_at_every_step_as_one_process_does(runs):
    """MLA under EP 2 x FSDP 2 with QK-clip: heads are clipped at every step (the logged max logit is above the
    threshold and the clipped-head count is positive), and the same heads as in one process: the per-head maxima
    are reduced over every rank before the clip."""
    name = "EP 2 x FSDP 2, DeepSeek-V3, MuonClip"
    run, control = runs[name]["attn"], runs[ONE_DSV3]["attn"]
    print(f"\n{name}: max logit {run['attn/max_logit']}, clipped heads {run['attn/clipped_heads']}")
    assert len(control["attn/max_logit"]) == STEPS and min(control["attn/max_logit"]) > QK_CLIP_THRESHOLD
    assert min(control["attn/clipped_heads"]) > 0
    assert run["attn/clipped_heads"] == control["attn/clipped_heads"]
    assert max(_rel(run["attn/max_logit"], control["attn/max_logit"])) <= 1e-4, (run, control)
