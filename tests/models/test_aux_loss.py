"""The MoE auxiliary loss travels with the model's output (models/aux_loss.py) and the step's loss weighs it
(train_step/aux_loss.py): one process, the debug Qwen3-MoE model (layer 0 dense, layers 1-3 sparse).

The layouts (pipeline stages over processes, EP, TP, CP, gradient accumulation) train with it in
tests/distributed/test_moe_layouts.py; scripts/loss_fingerprint.py shows its losses bitwise unchanged.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from torchtitan.distributed.activation_checkpoint import apply_activation_checkpointing
from torchtitan.models import get_model_spec, model_args
from torchtitan.models.aux_loss import WithAuxLoss, accept_carried_aux_loss, split_aux_loss
from torchtitan.models.common.parallel import prune_stage
from torchtitan.train_step.aux_loss import AuxLossTerm

WEIGHT = 0.01 / 3  # a coefficient over a step's forwards


def _model(aux_loss: str = "switch", seed: int = 0) -> torch.nn.Module:
    args = dataclasses.replace(model_args("qwen3", "debugmodel_moe"), vocab_size=256, dim=64, n_heads=4,
                               n_kv_heads=2, head_dim=16, ffn_hidden_size=96, moe_hidden_size=32,
                               aux_loss=aux_loss, aux_loss_coeff=0.01)
    torch.manual_seed(seed)
    model = get_model_spec("qwen3").build(args)
    model.init_weights()
    return model.train()


def _tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))


def _router_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if n.endswith("router.gate.weight")}


def _train(model: torch.nn.Module) -> tuple[WithAuxLoss, dict[str, torch.Tensor]]:
    output, aux = split_aux_loss(model(_tokens()))
    assert aux is not None
    term = AuxLossTerm(0.01, 3)
    term.weight = WEIGHT
    term.add_to(output.float().square().mean(), aux).backward()
    return (output, aux), _router_grads(model)


def test_a_training_forward_returns_the_summed_loss_of_its_layers_and_evaluation_none():
    model = _model()
    out, grads = _train(model)
    assert out[1].shape == (1,) and 3 * 0.9 < float(out[1].detach()) < 3 * 3  # Switch: ~1 a layer
    assert sorted(grads) == [f"layers.{i}.feed_forward.router.gate.weight" for i in (1, 2, 3)]
    without = _model("none")  # the same weights, no auxiliary loss: its routers get other gradients
    logits = without(_tokens())
    assert isinstance(logits, torch.Tensor)
    logits.float().square().mean().backward()
    assert all(not torch.equal(g, without.get_parameter(n).grad) for n, g in grads.items())
    model.eval()
    with torch.no_grad():
        assert isinstance(model(_tokens()), torch.Tensor)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_gives_the_same_loss_and_gradients(mode):
    plain_out, plain = _train(_model("sequence"))
    checkpointed = _model("sequence")
    apply_activation_checkpointing(checkpointed, mode, "op" if mode == "selective" else "")
    out, grads = _train(checkpointed)
    assert torch.equal(out[1], plain_out[1])
    assert all(torch.equal(grads[n], plain[n]) for n in plain)
    assert all(m.take_aux_loss() is None for m in checkpointed.moe_layers().values())  # the recompute kept none


def test_pipeline_stages_carry_the_running_sum_to_the_last_stage():
    """Two stages cut from the model, run one after the other as a schedule runs them: the last stage returns
    the whole model's summed loss, and its gradient reaches the first stage's routers."""
    whole = _model()
    want, want_grads = _train(whole)
    stages = []
    for layers, first, last in ((range(0, 2), True, False), (range(2, 4), False, True)):
        stage = copy.deepcopy(_model())
        prune_stage(stage, layers, first, last)
        stages.append(stage)
    accept_carried_aux_loss(stages[1])
    hidden, running = stages[0](_tokens())
    assert running.requires_grad  # the first stage's layer 1 is sparse; a dense stage sends a leaf that needs one
    received = (hidden.detach().requires_grad_(True), running.detach().requires_grad_(True))
    out = stages[1](*received)
    assert isinstance(out, tuple) and torch.equal(out[1], want[1])
    term = AuxLossTerm(0.01, 3)
    term.weight = WEIGHT
    term.add_to(out[0].float().square().mean(), out[1]).backward()
    torch.autograd.backward([hidden, running], [received[0].grad, received[1].grad])
    grads = {**_router_grads(stages[0]), **_router_grads(stages[1])}
    assert grads.keys() == want_grads.keys()
    assert all(torch.allclose(grads[n], want_grads[n], rtol=1e-5, atol=1e-7) for n in grads)
    assert grads["layers.1.feed_forward.router.gate.weight"].abs().sum() > 0  # through the carried sum


def test_the_term_weighs_the_loss_by_the_forwards_and_logs_the_mean_over_layers():
    term = AuxLossTerm(0.01, num_layers=3)
    term.start_step(forwards=4)
    assert term.weight == 0.01 * (1.0 / 4)
    aux = torch.tensor([3.0], requires_grad=True)
    total = term.add_to(torch.tensor(1.0, dtype=torch.float64), aux)
    total.backward()
    assert total.dtype == torch.float64 and aux.grad is not None
    assert aux.grad.item() == torch.tensor(0.01 * (1.0 / 4), dtype=torch.float32).item()  # float32(coeff / forwards)
    term.add_to(torch.tensor(0.0), torch.tensor([6.0]))
    mean_sum, layers = term.pop(torch.device("cpu"))
    assert (float(mean_sum), layers) == (4.5, 3)  # (3 + 6) / 2 forwards, over 3 layers: 1.5 a layer
    assert term.pop(torch.device("cpu"))[1] == 0
    split = AuxLossTerm(0.01, num_layers=3, tp_split=2)  # EP borrowing TP's ranks: each routes its own shard
    split.start_step(forwards=4)
    assert split.weight == 0.01 * (1.0 / 4) / 2  # as the layer's injected gradient was scaled before
