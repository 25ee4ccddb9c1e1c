"""Every expert-parallel layout trains the one-process MoE model, and its checkpoints resume anywhere.

The Qwen3-MoE debug model (8 experts, top-2, one dense layer), CPU float32, block-causal masks,
``training.deterministic``, the same global batch of 8 sequences in every layout, with both
balancers on: the auxiliary-loss-free routing bias (``--moe.load_balance_coeff``, default) and
DeepSeek's sequence-wise auxiliary loss. All 8-rank layouts train in one launch
(tests/distributed/moe_entry.py); one process is the control:

- each layout (the pipelined ones under Interleaved1F1B and ZBVZeroBubble; DualPipeV:
  test_deepseek_v3_layouts.py) starts from bitwise the one-process weights (EP 4 on TP 2 included: expert
  parallelism borrowing TP's ranks) (experts included; not checked under PP, whose ranks hold different layers),
  its step-1 loss is within 1e-5 and 6 steps within 1e-4 of the control's, and its routing biases end equal to
  the control's up to a few flipped choices;
- "EP2 x FSDP8" saves at step 3: the same layout resumed from it repeats steps 4-6 bitwise (routing
  bias included), and EP 1 and EP 2 x TP 2 resume it within 1e-4.

Degrees: "FSDP n" is the experts' ``efsdp`` = dp_shard x cp / ep; the dense weights shard over dp_shard x cp.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import REPO
from layout_entry import launch

pytestmark = pytest.mark.slow
STEPS, SEQ = 6, 64
HALF = STEPS // 2  # saved and logged every HALF steps
COMMON = ["--job.config_file", str(REPO / "train_configs" / "qwen3_debug_moe.toml"), f"--training.steps={STEPS}",
          f"--training.seq_len={SEQ}",
          "--job.print_args=false", "--metrics.enable_tensorboard=false", f"--metrics.log_freq={HALF}",
          "--training.deterministic", "--moe.aux_loss=sequence", "--moe.aux_loss_coeff=0.01",
          "--moe.load_balance_coeff=0.001", "--training.mixed_precision_param=float32"]


def _dims(shard: int = 8, ep: int = 2, batch: int = 1, **more: int) -> list[str]:
    names = {"rep": "data_parallel_replicate_degree", "tp": "tensor_parallel_degree", "cp": "context_parallel_degree",
             "pp": "pipeline_parallel_degree"}
    return [f"--parallelism.data_parallel_shard_degree={shard}", f"--parallelism.expert_parallel_degree={ep}",
            f"--training.batch_size={batch}", *(f"--parallelism.{names[k]}={v}" for k, v in more.items())]


SAVE = ["--checkpoint.enable_checkpoint", f"--checkpoint.interval={HALF}"]
NO_AUX = "--moe.aux_loss=none"
TB = "--metrics.enable_tensorboard=true"  # the MoE metrics are read back from TensorBoard
PP2 = ["--parallelism.pipeline_parallel_microbatches=2"]
PARITY = {
    "EP2 x FSDP4": _dims() + SAVE,  # dense FSDP 8; experts: 2 EP ranks x 4 efsdp ranks
    "EP8": _dims(ep=8),  # whole experts per rank, no expert sharding: the all-to-all over all 8 ranks
    "HSDP2 x FSDP2, EP2": _dims(shard=4, rep=2),
    # Gradient accumulation: the auxiliary loss and the counts add up over the micro-batches.
    "EP2 x TP2 x FSDP2, 2 micro-batches": _dims(shard=4, tp=2) + ["--training.gradient_accumulation_steps=2", TB],
    # The sequence-wise loss takes each CP rank's chunk as its sequence (docs/moe.md): without it here.
    "EP2 x CP2 x FSDP2": _dims(shard=4, batch=2, cp=2) + [NO_AUX],
    # Two stages a rank: the counts and the auxiliary loss of both reach the balance (1F1B is the simpler case).
    "EP2 x PP2 x FSDP2, interleaved": _dims(shard=4, batch=2, pp=2) + PP2 + [
        "--parallelism.pipeline_parallel_schedule=Interleaved1F1B", TB],
    # The zero-bubble schedules split each stage's backward into input and weight passes: the all-to-all and the
    # auxiliary loss's gradient in the first, the grouped experts' weight gradients in the second; V-shaped here.
    "EP2 x PP2 x FSDP2, ZBVZeroBubble": _dims(shard=4, batch=2, pp=2) + PP2 + [
        "--parallelism.pipeline_parallel_schedule=ZBVZeroBubble", TB],
    # EP borrowing TP's ranks (dp_shard 2 cannot hold EP 4): each TP rank routes its own sequence shard, sliced from
    # the replicated input without SP; its counts are summed over TP too. The sequence-wise loss would take each
    # shard as a sequence, as under CP: without it here.
    "EP4 on TP2 x FSDP2, HSDP2, no SP": _dims(shard=2, batch=2, rep=2, tp=2, ep=4) + [
        "--parallelism.enable_sequence_parallel=false", NO_AUX, TB],
}
RESUMED = {  # resumed at step HALF from "EP2 x FSDP4"
    "same layout": _dims(),
    "EP1": _dims(ep=1),
    "EP2 x TP2": _dims(shard=4, batch=2, tp=2),  # (pipeline layouts resume as any: tests/checkpoint)
}
SOURCE = "EP2 x FSDP4"


def _launch(root: Path, nproc: int, layouts: dict[str, dict]) -> dict:
    return launch(Path(__file__).with_name("moe_entry.py"), root, COMMON, layouts, nproc=nproc, timeout=2400,
                  env={"OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    one = ["--training.batch_size=8", "--parallelism.data_parallel_shard_degree=1"]
    control = _launch(tmp_path_factory.mktemp("moe_control"), 1, {"control": {"overrides": [*one, TB]},
                                                                   NO_AUX: {"overrides": [*one, NO_AUX, TB]}})
    layouts: dict[str, dict] = {name: {"overrides": o} for name, o in PARITY.items()}
    layouts.update({f"resumed {name}": {"overrides": [*o, "--checkpoint.enable_checkpoint"], "resume": SOURCE}
                    for name, o in RESUMED.items()})
    return {**control, **_launch(tmp_path_factory.mktemp("moe_layouts"), 8, layouts)}


def _rel(a: list[float], b: list[float]) -> list[float]:
    assert len(a) == len(b), (a, b)
    return [abs(x - y) / abs(y) for x, y in zip(a, b)]


@pytest.mark.parametrize("name", list(PARITY))
def test_layout_trains_the_one_process_moe_model(name, runs):
    control, run = runs[NO_AUX if NO_AUX in PARITY[name] else "control"], runs[name]
    if run["init"]:
        assert run["init"] == control["init"]  # bitwise: stacked experts drawn by (seed, name, shape)
    rel = _rel(run["losses"], control["losses"])
    # Adam is blind to a constant factor on a gradient, so the losses alone would not see expert gradients
    # doubled (or halved) by a wrong reduction over the expert ranks; the global gradient norm does.
    norms = _rel(run["grad_norms"], control["grad_norms"])
    print(f"{name}: step-1 rel {rel[0]:.1e}, max rel over {STEPS} steps {max(rel):.1e}; grad norm {max(norms):.1e}")
    assert rel[0] <= 1e-5 and max(rel) <= 1e-4, (name, rel)
    assert norms[0] <= 1e-4 and max(norms) <= 1e-3, (name, norms)
    assert run["biases"], "the routing bias is on"
    _assert_biases_close(name, run["biases"], control["biases"])
    assert control["losses"][-1] < control["losses"][0] - 0.15  # and the model learns (8.06 to 7.80 in 6 steps)


COEFF = 0.001  # --moe.load_balance_coeff


def _assert_biases_close(name: str, biases: dict[str, list[float]], reference: dict[str, list[float]]) -> None:
    """The routing biases agree, up to what a few flipped choices explain.

    A bias moves by +-coeff per step from the sign of (mean - count): a token whose top-k choice flips
    on a rounding difference between layouts changes a count by one and can move two biases by 2 coeff.
    So none is off by more than a few coeff, where a wrong count reduction (over TP, or not over the
    data ranks) moves them apart by up to 2 coeff per step, 2 x STEPS coeff over the run.
    """
    diffs = [abs(a - b) for fqn, bias in biases.items() for a, b in zip(bias, reference[fqn], strict=True)]
    differ = sum(d > 1e-6 for d in diffs)
    print(f"{name}: routing biases: {differ}/{len(diffs)} differ, by at most {max(diffs):.1e}")
    assert max(diffs) <= 4 * COEFF, (name, differ, max(diffs))


@pytest.mark.parametrize("name", list(RESUMED))
def test_checkpoint_of_ep2_resumes(name, runs):
    straight, resumed = runs[SOURCE], runs[f"resumed {name}"]
    tail = straight["losses"][HALF:]
    if name == "same layout":
        assert resumed["losses"] == tail  # bitwise
        assert resumed["biases"] == straight["biases"]
        return
    assert max(_rel(resumed["losses"], tail)) <= 1e-4, (name, resumed["losses"], tail)
    _assert_biases_close(name, resumed["biases"], straight["biases"])


@pytest.mark.parametrize("name", [n for n, o in PARITY.items() if TB in o])
def test_moe_metrics_count_every_rank_and_stage_once(name, runs):
    """Logged every HALF steps: the (token, slot) pairs per expert over the 3 sparse layers, summed over the data
    ranks once (not again over TP's copies, and over both pipeline stages), equal the one process's."""
    got, want = runs[name]["moe_metrics"], runs[NO_AUX if NO_AUX in PARITY[name] else "control"]["moe_metrics"]
    tokens = [got[f"moe/tokens_per_expert/{e}"] for e in range(8)]
    assert [sum(window) for window in zip(*tokens)] == [HALF * 8 * SEQ * 2 * 3] * 2  # steps x batch x seq x k x layers
    assert tokens == [want[f"moe/tokens_per_expert/{e}"] for e in range(8)]
    for key in ("moe/imbalance", "moe/imbalance_max", *(["moe/aux_loss"] if NO_AUX not in PARITY[name] else [])):
        assert max(_rel(got[key], want[key])) <= 1e-4, (key, got[key], want[key])
