"""Every layout trains the one-process DeepSeek-V3 debug model (MLA with a query LoRA and YaRN, 8 experts in
2 groups, one shared, the first layer dense), on CPU, float32, block-causal masks,
``training.deterministic``, the same global batch of 4 sequences everywhere, the routing bias moving.

All 4-rank layouts train in one launch (tests/distributed/moe_entry.py); one process is the control. Each
layout starts from bitwise the one-process weights (not checked under PP, whose ranks hold different
layers), its step-1 loss is within 1e-5 and 10 steps within 1e-4 of the control's, and so is the global
gradient norm (a gradient summed twice, or once too few, over TP shows there: Adam would hide it from
the losses). TP 2 runs with sequence parallelism: MLA shards its heads and keeps the latent path whole.
Multi-token prediction (one depth) runs under EP 2 x FSDP 4, TP 2 (SP) x FSDP 2 and EP 2 x PP 2 x FSDP 2
(InterleavedZeroBubble: the MTP module on the last of four stages, with its copy of the embedding) against a
one-process control with it on:
init bitwise (the embedding's two copies included), the losses and gradient norms as above, the logged MTP
loss (``mtp/loss``) within 1e-5 at step 1 and 1e-4 after, every parameter moved by training as far as in one
process (within 1e-4), and the embedding's two copies bitwise equal after training. A DeepSeek-V3 config made
with transformers trains as ``--model.flavor DIR`` from its weights under EP 2 x FSDP 4, its step-1 loss
transformers' own. Selective AC 'moe' under EP 2 x FSDP 4 trains the same model too, and sends as many expert
all-to-alls as that layout without AC (its recompute reuses the kept outputs). EP 2 x PP 2 trains it under
DualPipeV too (V-shaped, EP borrowing TP's ranks), and EP 4 x FSDP 4 with the two-hop dispatch over 2 "nodes" of 2
ranks (its sums grouped by node: within the same tolerances), without AC and under selective AC 'exchange', whose
recompute sends the first hop's way back again and not its dispatch; the two-hop dispatch also at EP 4 on TP 2 x FSDP 2
and at EP 2 x PP 2 x FSDP 2 (Interleaved1F1B, two stages a rank).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import REPO
from layout_entry import launch

pytestmark = pytest.mark.slow
STEPS, SEQ, BATCH = 10, 32, 4
MTP = "--model.mtp_layers=1"
# the MTP loss is read back from TensorBoard, logged at every step
TB = ["--metrics.enable_tensorboard=true", "--metrics.log_freq=1"]
RELEASE = "transformers release, EP2 x FSDP4"
SAC_MOE = "EP2 x FSDP4, selective AC moe"
TWO_HOP_NAME = "two-hop over 2 nodes"
TWO_HOP = f"EP4 x FSDP4, {TWO_HOP_NAME}"
TWO_HOP_EXCHANGE = f"{TWO_HOP}, selective AC exchange"
# layouts whose all-to-alls are counted (moe_entry.py)
COUNTED = ("EP2 x FSDP4", SAC_MOE, TWO_HOP, TWO_HOP_EXCHANGE)
COMMON = ["--job.config_file", str(REPO / "train_configs" / "deepseek_v3_debug.toml"), f"--training.steps={STEPS}",
          f"--training.seq_len={SEQ}", "--job.print_args=false", "--metrics.enable_tensorboard=false",
          f"--metrics.log_freq={STEPS}", "--training.deterministic", "--moe.load_balance_coeff=0.001",
          "--training.mixed_precision_param=float32"]


def _dims(shard: int, batch: int, ep: int = 1, **more: int) -> list[str]:
    names = {"rep": "data_parallel_replicate_degree", "tp": "tensor_parallel_degree", "cp": "context_parallel_degree",
             "pp": "pipeline_parallel_degree"}
    return [f"--parallelism.data_parallel_shard_degree={shard}", f"--parallelism.expert_parallel_degree={ep}",
            f"--training.batch_size={batch}", *(f"--parallelism.{names[k]}={v}" for k, v in more.items())]


PARITY = {
    "FSDP4": _dims(4, 1),
    "HSDP2 x FSDP2": _dims(2, 1, rep=2),
    "TP2 (SP) x FSDP2": _dims(2, 2, tp=2),
    "CP2 x FSDP2": _dims(2, 2, cp=2),
    "PP2 x FSDP2": _dims(2, 2, pp=2) + ["--parallelism.pipeline_parallel_microbatches=2"],
    "EP2 x FSDP4": _dims(4, 1, ep=2),
    # selective AC 'moe': the same model, and the all-to-alls' outputs kept, not sent again in the recompute
    SAC_MOE: _dims(4, 1, ep=2) + ["--activation_checkpoint.mode=selective",
                                  "--activation_checkpoint.selective_ac_option=moe"],
    # the two-hop dispatch (docs/moe.md): EP 4 as 2 "nodes" of 2 ranks, the shared expert beside the first hop
    TWO_HOP: _dims(4, 1, ep=4) + ["--moe.dispatch_gpus_per_node=2"],
    # selective AC 'exchange': the first hop's outputs kept (not sent again in the recompute), the rest recomputed
    TWO_HOP_EXCHANGE: _dims(4, 1, ep=4) + ["--moe.dispatch_gpus_per_node=2", "--activation_checkpoint.mode=selective",
                                           "--activation_checkpoint.selective_ac_option=exchange"],
    "EP2 x TP2": _dims(2, 2, ep=2, tp=2),
    # EP borrowing TP's ranks: each TP rank routes its own sequence shard to the 4 EP ranks (ParallelDims)
    "EP4 on TP2 x FSDP2": _dims(2, 2, ep=4, tp=2),
    # the two-hop dispatch where EP borrows TP's ranks, and under a pipeline of two stages a rank (each stage's
    # layers get their own hop groups): 2 "nodes" of 2 ranks, and 2 of one rank
    f"EP4 on TP2 x FSDP2, {TWO_HOP_NAME}": _dims(2, 2, ep=4, tp=2) + ["--moe.dispatch_gpus_per_node=2"],
    f"EP2 x PP2 x FSDP2, Interleaved1F1B, {TWO_HOP_NAME} of 1": _dims(2, 2, ep=2, pp=2) + [
        "--parallelism.pipeline_parallel_microbatches=2", "--parallelism.pipeline_parallel_schedule=Interleaved1F1B",
        "--moe.dispatch_gpus_per_node=1"],
    # multi-token prediction (one depth; its MoE block's experts EP-sharded too), against its own control
    "MTP, EP2 x FSDP4": _dims(4, 1, ep=2) + [MTP, *TB],
    # the MTP module's norms and eh_proj on the sequence shards, its block with a block's plan
    "MTP, TP2 (SP) x FSDP2": _dims(2, 2, tp=2) + [MTP, *TB],
    # the MTP module and a copy of the embedding on the last of 4 stages (rank 1 holds stages 1 and 3), under a
    # zero-bubble schedule with experts: the all-to-all inside each stage's input-gradient pass, the grouped
    # experts' weight gradients in a pass of their own (the looped interleaved order of Interleaved1F1B, which
    # test_moe_layouts.py runs with experts; the V shape cannot hold MTP: refused in preflight)
    "MTP, EP2 x PP2 x FSDP2, InterleavedZeroBubble": _dims(2, 2, ep=2, pp=2) + [
        "--parallelism.pipeline_parallel_microbatches=2",
        "--parallelism.pipeline_parallel_schedule=InterleavedZeroBubble", MTP, *TB],
    # ... and V-shaped (rank 0 holds stages 0 and 3; test_moe_layouts.py runs ZBVZeroBubble with experts): DualPipeV
    # needs a microbatch a stage (4), the whole batch on each rank, EP borrowing TP's ranks
    "EP2 on TP2 x PP2, DualPipeV": _dims(1, 4, ep=2, tp=2, pp=2) + [
        "--parallelism.pipeline_parallel_microbatches=4", "--parallelism.pipeline_parallel_schedule=DualPipeV"],
}


def _release(folder: Path) -> Path:
    """A DeepSeek-V3 config made with transformers (the shipped tokenizer's vocabulary), random weights, saved."""
    import torch
    import transformers

    config = transformers.DeepseekV3Config(
        vocab_size=2048, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=12, max_position_embeddings=SEQ, num_mtp_layers=0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.707,
                         "mscale_all_dim": 0.707, "original_max_position_embeddings": 8})
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).float()
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn_like(b))
    model.save_pretrained(folder)
    return folder


def _transformers_loss(folder: Path) -> float:
    """transformers' loss on the first global batch the trainer sees (the stream does not depend on the layout)."""
    import torch
    import transformers
    from conftest import SHIPPED_TOKENIZER

    from torchtitan.datasets import DataLayout, build_dataloader, build_tokenizer

    loader = build_dataloader(dataset_name="embedded", dataset_path=None, tokenizer=build_tokenizer(SHIPPED_TOKENIZER),
                              layout=DataLayout(SEQ, BATCH, 0, 1))
    inputs, labels = next(iter(loader))
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(inputs).logits
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1).double(), labels.flatten()))


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    return _release(tmp_path_factory.mktemp("dsv3_release"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, release) -> dict:
    entry = Path(__file__).with_name("moe_entry.py")
    one = {"control": {"overrides": _dims(1, BATCH)}, "control MTP": {"overrides": [*_dims(1, BATCH), MTP, *TB]}}
    control = launch(entry, tmp_path_factory.mktemp("dsv3_control"), COMMON, one, nproc=1, timeout=1200,
                     env={"OMP_NUM_THREADS": "1"})
    layouts = {name: {"overrides": o, "count_all_to_alls": name in COUNTED} for name, o in PARITY.items()}
    load = [f"--model.flavor={release}", f"--checkpoint.initial_load_path={release}",
            "--checkpoint.initial_load_format=hf", "--model.attn_mask_type=causal"]
    layouts[RELEASE] = {"overrides": [*_dims(4, 1, ep=2), *load]}
    return {**control, **launch(entry, tmp_path_factory.mktemp("dsv3_layouts"), COMMON, layouts, nproc=4,
                                timeout=2400, env={"OMP_NUM_THREADS": "1"})}


def _rel(a: list[float], b: list[float]) -> list[float]:
    assert len(a) == len(b), (a, b)
    return [abs(x - y) / abs(y) for x, y in zip(a, b)]


@pytest.mark.parametrize("name", list(PARITY))
def test_layout_trains_the_one_process_model(name, runs):
    control, run = runs["control MTP" if MTP in PARITY[name] else "control"], runs[name]
    if run["init"]:
        assert run["init"] == control["init"]
    rel, norms = _rel(run["losses"], control["losses"]), _rel(run["grad_norms"], control["grad_norms"])
    print(f"{name}: step-1 rel {rel[0]:.1e}, max rel over {STEPS} steps {max(rel):.1e}; grad norm {max(norms):.1e}")
    assert rel[0] <= 1e-5 and max(rel) <= 1e-4, (name, rel)
    # the MoE layouts' bound (test_moe_layouts.py): the norm moves by up to ~1e-4 where losses agree to 1e-7
    assert norms[0] <= 1e-4 and max(norms) <= 1e-3, (name, norms)
    assert run["biases"], "the routing bias is on"
    assert control["losses"][-1] < control["losses"][0]  # and the model learns
    # a parameter two pipeline stages hold (MTP's copy of the embedding) ends training the same on both
    assert "differs" not in run["final"].values(), [k for k, v in run["final"].items() if v == "differs"]
    if MTP in PARITY[name]:  # the MTP loss, logged apart, trains the same too
        mtp, want = run["moe_metrics"]["mtp/loss"], control["moe_metrics"]["mtp/loss"]
        mtp_rel = _rel(mtp, want)
        print(f"{name}: mtp/loss at the logged steps {mtp}, rel {mtp_rel}")
        assert len(want) == STEPS and mtp_rel[0] <= 1e-5 and max(mtp_rel) <= 1e-4, (name, mtp_rel)
    # Every parameter moved as far as in one process: the loss and norm bounds above miss a gradient that
    # one parameter lacks (MTP's embedding copy, MLA's rotary key or a router without its sum over TP).
    moved = {k: abs(v - control["moved"][k]) / control["moved"][k] for k, v in run["moved"].items()}
    assert run["moved"].keys() == control["moved"].keys() and max(moved.values()) <= 1e-4, (
        name, sorted(moved.items(), key=lambda kv: -kv[1])[:3])


def test_selective_ac_moe_sends_no_all_to_all_again(runs):
    """'moe' keeps every all-to-all's output (tokens and counts): its recompute sends none, so training under it
    sends as many as without AC (the parity test above: and trains the same model)."""
    plain, kept = (runs[name]["all_to_alls"] for name in COUNTED[:2])
    assert plain > 0 and kept == plain, (plain, kept)


def test_selective_ac_exchange_sends_the_first_hop_once(runs):
    """'exchange' with the two-hop dispatch keeps the first hop's dispatch outputs (tokens, counts, expert ids and
    weights, across nodes): its recompute sends only the way back across nodes again, one all-to-all per MoE layer
    and forward (full AC would send all five again), and the second hop's (within a node) again, as full AC would."""
    plain, kept = (runs[name]["all_to_alls_by_group"] for name in (TWO_HOP, TWO_HOP_EXCHANGE))
    moe_layers = 3  # the debug model's 4 layers, the first dense; one micro-batch a step
    assert plain["ep_inter_node"] > 0 and kept["ep_inter_node"] - plain["ep_inter_node"] == STEPS * moe_layers, (
        plain, kept)
    assert kept["ep_intra_node"] > plain["ep_intra_node"] > 0, (plain, kept)


def test_a_transformers_release_gives_transformers_step1_loss(runs, release):
    """``--model.flavor DIR`` of a config made with transformers, its weights loaded, EP 2 x FSDP 4 through the
    launcher: the step-1 loss is transformers' on the same batch (causal mask, as transformers attends)."""
    losses = runs[RELEASE]["losses"]
    assert losses[0] == pytest.approx(_transformers_loss(release), rel=1e-5)
    assert losses[1] != losses[0]


def test_mtp_trains_another_model(runs):
    """The main loss is what is logged: with MTP it starts the same (same init of the shared weights) and then
    moves apart, as the MTP loss's gradient reaches the shared embedding, blocks and output."""
    plain, mtp = runs["control"]["losses"], runs["control MTP"]["losses"]
    assert abs(mtp[0] - plain[0]) <= 1e-6 * plain[0] and max(_rel(mtp, plain)[1:]) > 1e-4
