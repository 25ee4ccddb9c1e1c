"""Multi-token prediction (DeepSeek-V3 report §2.2): the step's MTP loss against a direct computation from the
report's definition, the last pipeline stage's pruning (the MTP modules and a copy of the embedding), and the
layouts it cannot run in refused in one line before any process group."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO

from torchtitan.config import ConfigError, ConfigManager
from torchtitan.loss import IGNORE_INDEX, cross_entropy_sum
from torchtitan.metrics.logger import format_step_line
from torchtitan.models import model_args
from torchtitan.models.deepseek_v3.model import DeepSeekV3Model
from torchtitan.preflight import preflight
from torchtitan.train_step.mtp import MTPTerm, mtp_settings
from torchtitan.train_step.objective import CrossEntropyTerm, Objective

VOCAB, L, B, D, LAMBDA = 64, 24, 2, 2, 0.3


def _model() -> DeepSeekV3Model:
    args = dataclasses.replace(model_args("deepseek_v3", "debugmodel"), n_layers=2, vocab_size=VOCAB, max_seq_len=L,
                               num_mtp_layers=D, mtp_loss_weight=LAMBDA, attn_mask_type="causal")
    torch.manual_seed(0)
    model = DeepSeekV3Model(args)
    model.init_weights()
    return model


def _report_mtp_loss(model: DeepSeekV3Model, t: torch.Tensor) -> torch.Tensor:
    """lambda / D * sum_k L^k, L^k = -1/T sum_{i=2+k}^{T+1} log P^k_i[t_i] on a sequence t_1..t_{T+1} (1-based);
    each depth's sequence shortened by one: h^k_{1:T-k} = TRM_k(M_k [RMSNorm(h^{k-1}_i); RMSNorm(Emb(t_{i+k}))])."""
    assert model.tok_embeddings is not None and model.output is not None and model.mtp is not None
    inputs, T = t[:, :-1], t.shape[1] - 1
    backend = model.backend_for(t.device)  # causal SDPA: scores and rotation only
    h = model.tok_embeddings(inputs)
    for layer in model.layers.values():
        h = layer(h, model.rope_cache, backend=backend)
    total = torch.zeros(())
    for k, module in enumerate(model.mtp.values(), start=1):  # h^{k-1} covers positions 1..T-k+1
        emb = model.tok_embeddings(t[:, k:T])  # t_{i+k} for i = 1..T-k
        h = module.block(module.eh_proj(torch.cat([module.enorm(emb), module.hnorm(h[:, :T - k])], -1)),
                         model.rope_cache, backend=backend)
        logits = model.output(module.norm(h))  # P^k_{i+k+1}, i = 1..T-k
        total = total + F.cross_entropy(logits.flatten(0, 1), t[:, k + 1:].flatten(), reduction="sum") / (B * T)
    return LAMBDA / D * total


def test_mtp_loss_is_the_reports_definition():
    model = _model()
    t = torch.randint(0, VOCAB, (B, L + 1), generator=torch.Generator().manual_seed(3))
    tokens, labels = t[:, :-1], t[:, 1:]
    assert mtp_settings(model) == (D, LAMBDA)
    term = MTPTerm(D, LAMBDA, cross_entropy_sum)
    loss = Objective([CrossEntropyTerm(cross_entropy_sum), term])
    with torch.no_grad():
        outputs = model(tokens, **loss.model_kwargs(tokens))
        objective = loss(outputs, labels)
        main = cross_entropy_sum(outputs[0], labels)
        got = (objective - main) / labels.numel()  # the depths' part, over the step's 1/T (its loss scale)
        expected = _report_mtp_loss(model, t)
        plain = model(tokens)  # without the MTP keyword: the main logits alone, as with MTP off
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)
    assert len(outputs) == 1 + D and expected > 0.1 and torch.equal(outputs[0], plain)
    assert loss.logged_loss(objective.double(), torch.device("cpu")) == main.double()  # the main one alone
    metrics = loss.metrics([None])  # the logged value: the depths' mean of sum / T
    assert metrics["mtp/loss"] == pytest.approx(float(expected) / LAMBDA, rel=1e-5)
    assert "mtp_loss: " in format_step_line(1, {"loss": 3.0, **metrics})


def test_the_last_positions_of_each_depth_are_not_scored():
    from torchtitan.models.deepseek_v3.mtp import depth_tokens
    from torchtitan.train_step.mtp import depth_targets

    tokens, labels = torch.arange(6)[None], torch.arange(1, 7)[None]
    ids, targets = depth_tokens(tokens, 2), depth_targets(labels, 2)
    assert ids.tolist() == [[2, 3, 4, 5, 0, 1]] and targets.tolist() == [[3, 4, 5, 6, IGNORE_INDEX, IGNORE_INDEX]]


def test_mtp_gradients_reach_the_shared_weights_and_its_own():
    model = _model()
    tokens = torch.randint(0, VOCAB, (B, L))
    outputs = model(tokens, mtp_tokens=tokens)
    MTPTerm(D, LAMBDA, cross_entropy_sum)(outputs, torch.roll(tokens, -1, 1)).backward()  # the depths' loss alone
    assert model.mtp is not None and model.tok_embeddings is not None and model.output is not None
    for p in (model.tok_embeddings.weight, model.output.weight, model.layers["1"].attention.wkv_a.weight,
              *model.mtp.parameters()):
        assert p.grad is not None and p.grad.abs().sum() > 0


def _problems(world: int, *overrides: str) -> list[str]:
    cfg = ConfigManager().parse_args(["--job.config_file", str(REPO / "train_configs" / "deepseek_v3_debug.toml"),
                                      "--training.seq_len=64", *overrides])
    with pytest.raises(ConfigError) as info:
        preflight(cfg, world)
    return info.value.problems


def test_mtp_under_cp_is_refused_in_one_line():
    problems = _problems(2, "--model.mtp_layers=1", "--parallelism.context_parallel_degree=2",
                         "--parallelism.data_parallel_shard_degree=1", "--training.batch_size=2")
    assert problems == ["--model.mtp_layers=1 with --parallelism.context_parallel_degree=2: no schedule places the "
                        "multi-token prediction modules there yet (each depth reads the tokens further along the "
                        "sequence, which another CP rank holds); use --parallelism.context_parallel_degree=1 or "
                        "--model.mtp_layers=0"]


def test_mtp_with_a_v_shaped_schedule_is_refused_in_one_line():
    problems = _problems(2, "--model.mtp_layers=1", "--parallelism.pipeline_parallel_degree=2",
                         "--parallelism.pipeline_parallel_schedule=ZBVZeroBubble", "--training.batch_size=4",
                         "--parallelism.data_parallel_shard_degree=1")
    assert problems == ["--model.mtp_layers=1 with --parallelism.pipeline_parallel_schedule=ZBVZeroBubble: the "
                        "V-shaped schedule puts the first and the last stage, which both hold the embedding the MTP "
                        "modules share, on one rank; use a looped schedule (1F1B, Interleaved1F1B, ...) or "
                        "--model.mtp_layers=0"]


@pytest.mark.parametrize("flag", ["pipeline_parallel_degree", "tensor_parallel_degree"])
def test_mtp_under_pp_and_tp_passes_preflight(flag):
    cfg = ConfigManager().parse_args(["--job.config_file", str(REPO / "train_configs" / "deepseek_v3_debug.toml"),
                                      "--training.seq_len=64", "--model.mtp_layers=1", f"--parallelism.{flag}=2",
                                      "--parallelism.data_parallel_shard_degree=1", "--training.batch_size=2"])
    preflight(cfg, 2)


def test_the_last_stage_holds_the_mtp_modules_and_a_copy_of_the_embedding():
    whole = _model()
    first, last, middle = (copy.deepcopy(whole) for _ in range(3))
    first.prune_stage(range(0, 1), True, False)
    middle.prune_stage(range(1, 1), False, False)
    last.prune_stage(range(1, 2), False, True)
    assert first.mtp is None and middle.mtp is None and middle.tok_embeddings is None
    assert last.mtp is not None and last.tok_embeddings is not None and last.input_is_hidden
    assert not first.input_is_hidden and first.output is None
    # the last stage's input is the hidden state, not ids: its forward runs its blocks on it as it is
    h = torch.randn(B, L, first.args.dim)
    tokens = torch.randint(0, VOCAB, (B, L))
    with torch.no_grad():
        outputs = last(h, mtp_tokens=tokens)
        assert len(outputs) == 1 + D and torch.equal(outputs[0], last(h))


def test_mtp_on_a_family_without_it_is_refused_in_one_line():
    cfg = ConfigManager().parse_args(["--model.mtp_layers=2"])
    with pytest.raises(ConfigError) as info:
        preflight(cfg, 1)
    assert info.value.problems == ["--model.mtp_layers=2: model family llama3 has no multi-token prediction; use "
                                   "--model.name=deepseek_v3 or --model.mtp_layers=0"]


def test_tp_must_divide_the_heads():
    problems = _problems(3, "--parallelism.tensor_parallel_degree=3", "--parallelism.data_parallel_shard_degree=1",
                         "--training.seq_len=66")
    assert any("n_heads (8) is not divisible by it" in p for p in problems) and all("\n" not in p for p in problems)


class _Echo(torch.nn.Module):
    """Stands in for an MTP module's block: hands back what ``eh_proj`` gave it."""

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor, **_: object) -> torch.Tensor:
        return x


def test_eh_proj_under_sequence_parallel_runs_on_the_local_rows():
    # torch 2.11's DTensor cannot flatten [B, L/tp, 2 dim] with the sequence sharded, as a DTensor linear would:
    # TP with MTP failed there. As rank 1 of a fake TP 2 world (nothing in this forward and backward communicates).
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from torchtitan import compat

    model = _model()
    assert model.mtp is not None
    module = next(iter(model.mtp.values()))
    module.block = _Echo()
    plain = copy.deepcopy(module)
    backend = model.backend_for(torch.device("cpu"))
    h, emb = torch.randn(B, L // 2, model.args.dim), torch.randn(B, L // 2, model.args.dim)
    dist.init_process_group("fake", store=compat.fake_process_group_store(), rank=1, world_size=2)
    try:
        parallelize_module(model, init_device_mesh("cpu", (2,)), model.extra_tp_plan(Shard(1)))
        out = module(h, emb, torch.empty(0), backend=backend)
        out.sum().backward()
    finally:
        dist.destroy_process_group()
    want = plain(h, emb, torch.empty(0), backend=backend)
    want.sum().backward()
    grad = module.eh_proj.weight.grad
    assert not isinstance(out, DTensor) and torch.equal(out, want)
    # This rank's share of the weight's gradient, summed over TP with the other Partial gradients before clipping.
    assert isinstance(grad, DTensor) and grad.placements == (Partial(),), grad
    assert torch.equal(grad.to_local(), plain.eh_proj.weight.grad)
