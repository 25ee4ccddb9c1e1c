"""Tensor- and context-parallel layouts train the same model as one process.

Same method as test_layout_parity.py (same seed, data and global batch of 8
sequences, float32, deterministic), over 6 steps (the tied flavor's
layouts are test_layout_parity.py's and test_releases.py's): the gathered
initial weights must equal the single-process init bitwise, every step's loss must
stay within the parity tolerance of the control's, and so must the validation loss
at the last step (held-out data, as in test_layout_parity.py). One process group per
world size trains its layouts one after another, so CI spawns each size once.
"""

from __future__ import annotations

import pytest
from dist_harness import run_ranks
from test_layout_parity import _init_and_train, assert_validation_parity, spawn_layouts

pytestmark = pytest.mark.slow  # every test here starts processes

STEPS = 6
TP2, CP2 = "--parallelism.tensor_parallel_degree=2", "--parallelism.context_parallel_degree=2"


def _dp(replicate: int, shard: int) -> list[str]:
    return [f"--parallelism.data_parallel_replicate_degree={replicate}",
            f"--parallelism.data_parallel_shard_degree={shard}", f"--training.batch_size={8 // (replicate * shard)}"]


# name -> (ranks, overrides); the local batch keeps the global batch at 8.
LAYOUTS = {
    "TP2 x FSDP4": (8, [TP2, *_dp(1, 4)]),
    "TP2 (no SP) x FSDP4": (8, [TP2, *_dp(1, 4), "--parallelism.enable_sequence_parallel=false"]),
    "HSDP2x2 x TP2": (8, [TP2, *_dp(2, 2)]),
    "CP2 x FSDP4": (8, [CP2, *_dp(1, 4)]),
    "HSDP2x2 x CP2": (8, [CP2, *_dp(2, 2)]),
    "FSDP2 x TP2 x CP2": (8, [TP2, CP2, *_dp(1, 2)]),
}


@pytest.fixture(scope="module")
def control(tmp_path_factory) -> dict:
    dump = str(tmp_path_factory.mktemp("control"))
    (result,) = run_ranks(_init_and_train, 1, dump, [f"--training.steps={STEPS}", "--training.batch_size=8"], True,
                          False, timeout=1500)
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    return spawn_layouts(tmp_path_factory, LAYOUTS, steps=STEPS, tied=False)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_control(name, control, runs):
    results = runs[name]
    assert results[0]["full"] == control["full"]  # bitwise the same initial model
    losses, reference = results[0]["losses"], control["losses"]
    assert all(r["losses"] == losses for r in results)  # the logged loss is global: same on all ranks
    rel = [abs(a - b) / abs(b) for a, b in zip(losses, reference)]
    print(f"\n{name}: step-1 rel {rel[0]:.2e}, max rel over {STEPS} steps {max(rel):.2e}")
    assert len(losses) == STEPS
    assert rel[0] <= 1e-6
    assert max(rel) <= 1e-4
    assert_validation_parity(name, results, control)  # validated at the last step
