"""Every layout trains the one-process GPT-OSS debug model; a transformers GPT-OSS folder trains as transformers
scores it.

The debug model (train_configs/gpt_oss_debug.toml: sinks, a 16-key window on alternate layers, biased q/k/v/o,
biased experts, a router bias; every bias and sink drawn non-zero), CPU float32, block-causal masks over the
data's documents, a sequence (32) longer than the window, ``training.deterministic``, the same global batch of 4
sequences in every layout. All 4-rank layouts train in one launch (tests/distributed/moe_entry.py); one
process is the control. Each layout starts bitwise from the control's weights (not under PP, whose ranks hold
different layers), and its step-1 loss is within 1e-5 and 10 steps within 1e-4 of the control's.

TP 2 and TP 4 would see an output bias added once per TP rank (the attention's ``wo``, replicated beside a
row-parallel weight; the experts', replicated over TP): their losses would leave the control's from step 1.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import REPO
from layout_entry import launch

pytestmark = pytest.mark.slow
STEPS, SEQ, BATCH = 10, 32, 4
CONFIG = str(REPO / "train_configs" / "gpt_oss_debug.toml")
COMMON = ["--job.config_file", CONFIG, f"--training.steps={STEPS}", f"--training.seq_len={SEQ}",
          "--job.print_args=false", "--metrics.enable_tensorboard=false", f"--metrics.log_freq={STEPS}",
          "--training.deterministic", "--training.mixed_precision_param=float32"]


def _dims(shard: int, batch: int, **more: int) -> dict:
    names = {"rep": "data_parallel_replicate_degree", "tp": "tensor_parallel_degree", "cp": "context_parallel_degree",
             "pp": "pipeline_parallel_degree", "ep": "expert_parallel_degree"}
    return {"overrides": [f"--parallelism.data_parallel_shard_degree={shard}", f"--training.batch_size={batch}",
                          *(f"--parallelism.{names[k]}={v}" for k, v in more.items())]}


LAYOUTS = {
    "FSDP4": _dims(4, 1),
    "HSDP2 x FSDP2": _dims(2, 1, rep=2),
    "TP2 (SP) x FSDP2": _dims(2, 2, tp=2),
    "TP4 (SP)": _dims(1, 4, tp=4),  # the biases added once at any degree
    "CP2 x FSDP2": _dims(2, 2, cp=2),
    "PP2 x FSDP2": _dims(2, 2, pp=2),
    "EP2 x FSDP4": _dims(4, 1, ep=2),  # experts: 2 EP ranks x 2 efsdp ranks
    "EP2 x TP2 x FSDP2": _dims(2, 2, tp=2, ep=2),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    entry = Path(__file__).with_name("moe_entry.py")
    env = {"OMP_NUM_THREADS": "1"}
    control = launch(entry, tmp_path_factory.mktemp("gpt_oss_control"), COMMON,
                     {"control": _dims(1, BATCH)}, nproc=1, timeout=1200, env=env)
    return {**control, **launch(entry, tmp_path_factory.mktemp("gpt_oss_layouts"), COMMON, LAYOUTS, nproc=4,
                                timeout=2400, env=env)}


def _rel(a: list[float], b: list[float]) -> list[float]:
    assert len(a) == len(b), (a, b)
    return [abs(x - y) / abs(y) for x, y in zip(a, b)]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_trains_the_one_process_gpt_oss_model(name, runs):
    control, run = runs["control"], runs[name]
    if run["init"]:
        assert run["init"] == control["init"]  # bitwise, biases and sinks included
    rel = _rel(run["losses"], control["losses"])
    norms = _rel(run["grad_norms"], control["grad_norms"])
    print(f"{name}: step-1 rel {rel[0]:.1e}, max rel over {STEPS} steps {max(rel):.1e}; grad norm {max(norms):.1e}")
    assert rel[0] <= 1e-5 and max(rel) <= 1e-4, (name, rel)
    assert norms[0] <= 1e-4 and max(norms) <= 1e-3, (name, norms)
    assert control["losses"][-1] < control["losses"][0]
