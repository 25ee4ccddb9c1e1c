"""Bad steps through the launchers: skipped bitwise in every layout, and rolled back past after too many.

- One launch of 2 ranks trains each layout in turn (tests/stability/stability_entry.py, which
  records the full model and optimizer state after every step): FSDP 2 with everything off; FSDP 2 with
  the spike detector on, which must train bitwise as the run without it (and judge steps, not only warm
  up); FSDP 2, PP 2 and TP 2 (loss parallel) with a NaN gradient injected at step 5, z-loss on, where
  the model and optimizer after step 5 must equal those after step 4 bitwise, step 6 must train again,
  the LR schedule must run as in the run without a skip, and losses and z-loss must agree across the
  layouts; and FSDP 2 rolling back after two skips in a row.
- ``python train.py`` in one process, checkpointing every step, NaN gradients at steps 5 and 6 and
  ``max_consecutive_skips=2``: the checkpoint of step 5 equals that of step 4 bitwise, the run rolls
  back to step 5, skips the data of step 6 (its loader ends one window further on) and finishes.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CI_CONFIG, REPO, torchrun_env

sys.path.insert(0, str(REPO / "tests" / "distributed"))
sys.path.insert(0, str(REPO / "tests" / "checkpoint"))
from helpers import checkpoint_digests, checkpoint_tensors  # noqa: E402
from layout_entry import launch  # noqa: E402

pytestmark = pytest.mark.slow
STEPS, BAD = 6, 5
COMMON = ["--job.config_file", CI_CONFIG, f"--training.steps={STEPS}", "--job.print_args=false",
          "--metrics.enable_tensorboard=false", f"--metrics.log_freq={STEPS}"]
FSDP2 = ["--parallelism.data_parallel_shard_degree=2", "--training.batch_size=1"]
PP2 = ["--parallelism.pipeline_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1",
       "--training.batch_size=2"]
TP2 = ["--parallelism.tensor_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1",
       "--training.batch_size=2"]
HSDP2 = ["--parallelism.data_parallel_replicate_degree=2", "--parallelism.data_parallel_shard_degree=1",
         "--training.batch_size=1"]
CP2 = ["--parallelism.context_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1",
       "--training.batch_size=2"]
SPIKES = ["--stability.skip_spikes", "--stability.spike_warmup_steps=2", "--stability.rolling_interval_length=4"]
GUARD = ["--stability.skip_nonfinite_steps", *SPIKES]
# z-loss large enough that a wrong gradient of it would show in the next steps' losses.
NAN_AT_5 = [*GUARD, f"--debug.inject_nonfinite_grad={BAD}", "--stability.z_loss_multiplier=0.05"]
ROLLBACK = ["--stability.skip_nonfinite_steps", "--stability.max_consecutive_skips=2",
            f"--debug.inject_nonfinite_grad={BAD},{BAD + 1}", "--checkpoint.enable_checkpoint",
            "--checkpoint.interval=1", f"--training.steps={STEPS + 1}"]
LAYOUTS = {
    "FSDP 2, off": FSDP2,
    "FSDP 2, spike detector": FSDP2 + GUARD,
    "FSDP 2, NaN at 5": FSDP2 + NAN_AT_5,
    "PP 2, NaN at 5": PP2 + NAN_AT_5,
    "TP 2, NaN at 5": TP2 + NAN_AT_5,
    "HSDP 2x1, NaN at 5": HSDP2 + NAN_AT_5,
    "CP 2, NaN at 5": CP2 + NAN_AT_5,
    "FSDP 2, rollback": FSDP2 + ROLLBACK,
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("bad_steps")
    return launch(REPO / "tests" / "stability" / "stability_entry.py", root, COMMON,
                  {name: {"overrides": overrides} for name, overrides in LAYOUTS.items()}, nproc=2, timeout=600)


def test_spike_detector_without_spikes_trains_bitwise_as_without_it(runs):
    off, on = runs["FSDP 2, off"], runs["FSDP 2, spike detector"]
    assert on["skipped_total"] == 0
    assert on["spike_stats_count"] == STEPS, "every step was judged and accepted into the statistics"
    for a, b in zip(off["steps"], on["steps"], strict=True):
        assert (a["model"], a["optim"], a["loss"]) == (b["model"], b["optim"], b["loss"]), a["step"]


NAN_LAYOUTS = ["FSDP 2, NaN at 5", "PP 2, NaN at 5", "TP 2, NaN at 5", "HSDP 2x1, NaN at 5", "CP 2, NaN at 5"]


@pytest.mark.parametrize("layout", NAN_LAYOUTS)
def test_a_non_finite_step_leaves_model_and_optimizer_bitwise_alone(runs, layout):
    steps = runs[layout]["steps"]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert [s["skipped"] for s in steps] == [s["step"] == BAD for s in steps]
    assert runs[layout]["skipped_total"] == 1
    before, bad, after = steps[BAD - 2], steps[BAD - 1], steps[BAD]
    assert (bad["model"], bad["optim"]) == (before["model"], before["optim"]), "step 5 changed the state"
    assert after["model"] != bad["model"] and after["optim"] != bad["optim"], "step 6 must train again"
    # The LR schedule follows the training step: the skipped step used up its learning rate.
    assert [s["lr"] for s in steps] == [s["lr"] for s in runs["FSDP 2, off"]["steps"]]


def test_losses_and_z_loss_agree_across_layouts(runs):
    """z-loss under loss parallel (TP), through the pipeline, replicated (HSDP) and with the sequence split (CP)
    equals the plain computation (FSDP)."""
    want = runs["FSDP 2, NaN at 5"]["steps"]
    for layout in NAN_LAYOUTS[1:]:
        for a, b in zip(want, runs[layout]["steps"], strict=True):
            assert a["z_loss"] > 0
            assert abs(a["z_loss"] - b["z_loss"]) <= 1e-5 * a["z_loss"], (layout, a["step"], a["z_loss"], b["z_loss"])
            assert abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"], (layout, a["step"], a["loss"], b["loss"])


def test_fsdp_rolls_back_after_consecutive_skips_and_finishes(runs):
    steps = runs["FSDP 2, rollback"]["steps"]
    # Steps 5 and 6 skipped; the run reloads step 5's checkpoint and takes steps 6 and 7 on later data.
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5, 6, 6, 7]
    assert [s["skipped"] for s in steps] == [False] * 4 + [True, True, False, False]
    assert steps[4]["model"] == steps[3]["model"]
    assert steps[6]["model"] != steps[5]["model"] and steps[6]["loss"] != steps[5]["loss"]
    assert runs["FSDP 2, rollback"]["skipped_total"] == 2


def test_one_process_through_train_py_skips_bitwise_rolls_back_and_finishes(tmp_path):
    dump = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "train.py", *COMMON, f"--job.dump_folder={dump}", "--metrics.log_freq=1", *ROLLBACK],
        cwd=REPO, env=torchrun_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-6000:]
    ckpt = dump / "checkpoint"
    assert checkpoint_digests(ckpt / f"step-{BAD}") == checkpoint_digests(ckpt / f"step-{BAD - 1}")
    assert checkpoint_digests(ckpt / f"step-{BAD + 1}")[0] != checkpoint_digests(ckpt / f"step-{BAD}")[0]
    line = next(line for line in done.stderr.splitlines() if "Rollback:" in line)
    assert re.search(rf"2 steps in a row skipped \(noticed at step {BAD + 1}\); reloaded the checkpoint of step "
                     rf"{BAD} and skip the data of steps {BAD + 1}-{BAD + 1} \(the run's global samples {BAD}-{BAD},",
                     line), line
    logged = [int(m.group(1)) for m in re.finditer(r"step: (\d+) ", done.stderr)]
    assert logged == [1, 2, 3, 4, 5, 6, 7], logged  # step 6's first try rolled back before its log line
    final = checkpoint_tensors(ckpt / f"step-{STEPS + 1}", "stability.")
    assert int(final["stability.data_steps_skipped"]) == 1
    assert _next_window(ckpt / f"step-{STEPS + 1}") == STEPS + 2, "the loader passed over one step's batch"


def _next_window(path: Path) -> int:
    import torch.distributed.checkpoint as dcp

    from torchtitan.checkpoint.states import saved_data_position
    from torchtitan.checkpoint.store import read_dcp_metadata

    state = {"dataloader": saved_data_position(read_dcp_metadata(path))}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return int(state["dataloader"]["next_window"])
