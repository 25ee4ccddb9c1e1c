"""torch.compile trains every tensor-parallel layout as eager does.

Each layout trains 5 steps eager, then compiled, in one 4-rank launch
(tests/distributed/compile_entry.py); their losses must agree within 1e-4 relative at every step.
Three layouts cover TP with and without sequence parallel, TP x PP, TP x CP and FSDP x TP. Without
``compat.wait_async_collective`` on the embedding's output, every one of them fails in backward
(docs/versions.md, "torch.compile and tensor parallelism").
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import REPO
from layout_entry import launch

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent
STEPS = 5
TP2 = "--parallelism.tensor_parallel_degree=2"
COMMON = ["--job.config_file", str(REPO / "train_configs" / "debug_model_ci.toml"), f"--training.steps={STEPS}",
          "--metrics.enable_tensorboard=false", "--parallelism.data_parallel_shard_degree=1"]
# name -> overrides, each on 4 ranks
LAYOUTS = {
    "FSDP2 x TP2 (SP)": [TP2, "--parallelism.data_parallel_shard_degree=2"],
    "TP2 (no SP) x CP2": [TP2, "--parallelism.context_parallel_degree=2",
                          "--parallelism.enable_sequence_parallel=false"],
    "TP2 x PP2 (SP)": [TP2, "--parallelism.pipeline_parallel_degree=2", "--training.batch_size=2"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    # Inductor's pool of compile workers is more processes than 2 cores want.
    return launch(HERE / "compile_entry.py", tmp_path_factory.mktemp("compile_tp"), COMMON,
                  {name: {"overrides": o} for name, o in LAYOUTS.items()}, nproc=4, timeout=1800,
                  env={"OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"})


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_compiled_losses_match_eager(name, runs):
    eager, compiled = runs[name]["eager"], runs[name]["compiled"]
    assert eager["compiled_blocks"] == 0 and compiled["compiled_blocks"] == compiled["blocks"] > 0
    assert len(eager["losses"]) == len(compiled["losses"]) == STEPS
    rel = [abs(c - e) / abs(e) for c, e in zip(compiled["losses"], eager["losses"])]
    print(f"\n{name}: max rel over {STEPS} steps {max(rel):.2e}")
    assert max(rel) <= 1e-4, (eager["losses"], compiled["losses"])
