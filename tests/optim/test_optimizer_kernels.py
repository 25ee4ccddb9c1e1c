"""Which AdamW kernel the routed experts' stacked weights take, and the one line that says so.

Under expert parallelism with FSDP the experts' weights are DTensors on the ``efsdp`` mesh, the rest on the
dense one; the update must stay one fused (or foreach) call over all of them, never torch's per-tensor loop.
One gloo process group of one rank in this process (no process started) holds the two meshes.
"""

from __future__ import annotations

import importlib
import logging

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from torchtitan.models.moe.experts import GroupedExperts
from torchtitan.optim import optimizer as optimizer_module
from torchtitan.optim.optimizer import build_optimizer

ADAMW = {"name": "AdamW", "lr": 1e-2, "eps": 1e-8, "weight_decay": 0.1, "betas": (0.9, 0.95)}


class _MoEPart(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.Linear(16, 16)
        self.experts = GroupedExperts(16, 32, num_experts=4)


@pytest.fixture
def one_rank_world():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # in memory: no port to take
    yield init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_shard", "efsdp"))
    dist.destroy_process_group()


def test_experts_on_their_own_mesh_take_one_fused_call_with_the_dense_weights(one_rank_world, monkeypatch, caplog):
    torch.manual_seed(0)
    part = _MoEPart()
    for p in part.parameters():
        torch.nn.init.normal_(p, std=0.1)
    reference = [p.detach().clone() for p in part.parameters()]
    dense_mesh, expert_mesh = one_rank_world["dp_shard"], one_rank_world["efsdp"]
    for module, mesh in ((part.norm, dense_mesh), (part.experts, expert_mesh)):
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
    params = list(part.parameters())
    assert {p.device_mesh.mesh_dim_names for p in params if isinstance(p, DTensor)} == {("dp_shard",), ("efsdp",)}
    calls: list[tuple[str, int]] = []
    adam = importlib.import_module("torch.optim.adam")  # AdamW's kernels live there (torch 2.11, 2.13)
    for kernel in ("_fused_adam", "_multi_tensor_adam", "_single_tensor_adam"):
        def counted(params_, *args, _kernel=adam.__dict__[kernel], _name=kernel, **kwargs):  # noqa: ANN001, ANN202
            calls.append((_name, len(params_)))
            return _kernel(params_, *args, **kwargs)
        monkeypatch.setattr(adam, kernel, counted)
    with caplog.at_level(logging.INFO, logger=optimizer_module.__name__):
        optimizer = build_optimizer(params, device_type="cpu", model_parts=[part], **ADAMW)
    assert [r.getMessage() for r in caplog.records] == [
        "AdamW: the fused kernel over 5 tensors in 1 param group(s), the routed experts' 3 stacked weights among them"]
    grads = [torch.randn_like(t) for t in reference]
    for p, g in zip(params, grads, strict=True):
        p.grad = distribute_tensor(g, p.device_mesh, p.placements)
    optimizer.step()
    assert calls == [("_fused_adam", 5)]  # one call over dense and expert weights, no per-tensor loop
    # The same update as plain tensors get.
    plain = [torch.nn.Parameter(t.clone()) for t in reference]
    for p, g in zip(plain, grads, strict=True):
        p.grad = g
    torch.optim.AdamW(plain, lr=1e-2, eps=1e-8, weight_decay=0.1, betas=(0.9, 0.95), fused=True).step()
    for got, want in zip(params, plain, strict=True):
        assert torch.equal(got.to_local(), want.detach())


def test_foreach_says_why_fused_is_skipped(caplog):
    params = [torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64)), torch.nn.Parameter(torch.zeros(3))]
    with caplog.at_level(logging.INFO, logger=optimizer_module.__name__):
        build_optimizer(params, device_type="cpu", **ADAMW)
        build_optimizer(params[1:], device_type="meta", **ADAMW)
    assert [r.getMessage() for r in caplog.records] == [
        "AdamW: the foreach kernel over 2 tensors in 1 param group(s) (fused skipped: the fused kernel takes no "
        "torch.complex64)",
        f"AdamW: the foreach kernel over 1 tensors in 1 param group(s) (fused skipped: torch {torch.__version__} has "
        "no fused kernel for meta)"]
