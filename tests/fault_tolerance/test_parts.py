"""The pieces of fault tolerance on their own: stale store keys, Adam's and Muon's state from step 0,
the heal state's round trip (AdamW and Muon), the check that every parameter sits in a hooked FSDP unit,
DiLoCo's fragments (every parameter in exactly one), and the startup wait's decisions."""

from __future__ import annotations

import copy
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks

from torchtitan.fault_tolerance.state import HealState, init_optimizer_state
from torchtitan.optim.muon import Muon, MuonSettings


def test_stale_manager_keys_are_deleted(monkeypatch, free_port):
    from torchft.manager import MANAGER_ADDR_KEY, REPLICA_ID_KEY

    from torchtitan.fault_tolerance.manager import clear_stale_manager_keys

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    server.set(MANAGER_ADDR_KEY, "http://dead-manager:1234")
    server.set(REPLICA_ID_KEY, "replica_group_1:dead")
    server.set("unrelated", "kept")
    assert sorted(clear_stale_manager_keys(5)) == sorted([MANAGER_ADDR_KEY, REPLICA_ID_KEY])
    assert not server.check([MANAGER_ADDR_KEY]) and not server.check([REPLICA_ID_KEY])
    assert server.get("unrelated") == b"kept"
    assert clear_stale_manager_keys(5) == []  # a first round finds nothing to delete


def _model_and_adamw() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)


def _model_and_muon() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Muon on the weights (momentum buffers), AdamW on the biases (moments): both kinds of state."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    return model, Muon([m.weight for m in model], [m.bias for m in model], lr=1e-2, weight_decay=0.1,
                       betas=(0.9, 0.95), eps=1e-8, settings=MuonSettings(ns_dtype="float32"))


BUILDERS = {"adamw": _model_and_adamw, "muon": _model_and_muon}


def _steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, n: int) -> None:
    for i in range(n):
        torch.manual_seed(100 + i)
        model(torch.randn(3, 4)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def test_adam_state_from_step_zero_changes_nothing():
    lazy_model, lazy = _model_and_adamw()
    eager_model, eager = _model_and_adamw()
    init_optimizer_state(eager)
    assert all(float(eager.state[p]["step"]) == 0 and not eager.state[p]["exp_avg"].any()
               for p in eager_model.parameters())
    _steps(lazy_model, lazy, 3)
    _steps(eager_model, eager, 3)
    for a, b in zip(lazy_model.parameters(), eager_model.parameters()):
        assert torch.equal(a, b)
        assert all(torch.equal(lazy.state[a][k], eager.state[b][k]) for k in ("step", "exp_avg", "exp_avg_sq"))


def test_muon_state_from_step_zero_is_the_first_steps_and_changes_nothing():
    """Every parameter gets the keys, shapes and dtypes Muon's first step creates (a momentum buffer for a
    matrix, AdamW's step and moments for the rest), all zero; training from there is bitwise the lazy run."""
    lazy_model, lazy = _model_and_muon()
    eager_model, eager = _model_and_muon()
    init_optimizer_state(eager)
    created = {name: {k: (v.shape, v.dtype, v.device) for k, v in eager.state[p].items()}
               for name, p in eager_model.named_parameters()}
    assert all(not v.any() for p in eager_model.parameters() for v in eager.state[p].values())
    assert set(created["0.weight"]) == {"momentum_buffer"} and set(created["0.bias"]) == {"step", "exp_avg",
                                                                                         "exp_avg_sq"}
    _steps(lazy_model, lazy, 3)
    _steps(eager_model, eager, 3)
    assert created == {name: {k: (v.shape, v.dtype, v.device) for k, v in lazy.state[p].items()}
                       for name, p in lazy_model.named_parameters()}
    for a, b in zip(lazy_model.parameters(), eager_model.parameters()):
        assert torch.equal(a, b) and all(torch.equal(v, eager.state[b][k]) for k, v in lazy.state[a].items())


class _Position:
    def __init__(self):
        self.value = {"step": 0, "data": {"next_window": 0}}

    def get(self):
        return self.value

    def set(self, value):
        self.value = copy.deepcopy(value)


def _heal_state(model, optimizer, position: _Position) -> tuple[HealState, torch.optim.lr_scheduler.LRScheduler]:
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    return HealState([model], optimizer, scheduler, position.get, position.set), scheduler


@pytest.mark.parametrize("optimizer", sorted(BUILDERS))
def test_heal_state_hands_over_references_and_loads_bitwise(optimizer):
    """A group that never stepped (its state created eagerly) takes a peer's state and steps bitwise like it."""
    peer_model, peer_opt = BUILDERS[optimizer]()
    init_optimizer_state(peer_opt)
    peer_pos = _Position()
    peer, peer_sched = _heal_state(peer_model, peer_opt, peer_pos)
    _steps(peer_model, peer_opt, 2)
    peer_sched.step()
    peer_sched.step()
    peer_pos.value = {"step": 2, "data": {"next_window": 16}}
    peer.refresh()
    handed = peer.state_dict()
    # References, not copies: nothing is read from the modules on the quorum thread.
    assert handed["model"]["0.0.weight"].data_ptr() == peer_model[0].weight.data_ptr()

    model, opt = BUILDERS[optimizer]()
    torch.manual_seed(5)
    for p in model.parameters():
        p.data.normal_()
    init_optimizer_state(opt)
    pos = _Position()
    mine, sched = _heal_state(model, opt, pos)
    mine.load_state_dict(copy.deepcopy(handed))
    for a, b in zip(peer_model.parameters(), model.parameters()):
        assert torch.equal(a, b)
        assert peer_opt.state[a].keys() == opt.state[b].keys()
        assert all(torch.equal(v, opt.state[b][k]) for k, v in peer_opt.state[a].items())
    assert sched.last_epoch == peer_sched.last_epoch and opt.param_groups[0]["lr"] == peer_opt.param_groups[0]["lr"]
    assert pos.value == {"step": 2, "data": {"next_window": 16}}
    _steps(peer_model, peer_opt, 1)
    _steps(model, opt, 1)
    assert all(torch.equal(a, b) for a, b in zip(peer_model.parameters(), model.parameters()))


def test_a_peer_state_of_another_optimizer_is_refused_before_anything_is_copied():
    """A group started with AdamW healing from a Muon group: one line naming the parameter and the fix."""
    peer_model, peer_opt = _model_and_muon()
    init_optimizer_state(peer_opt)
    peer, _ = _heal_state(peer_model, peer_opt, _Position())
    peer.refresh()
    model, opt = _model_and_adamw()
    with torch.no_grad():
        model[0].weight.add_(1.0)
    init_optimizer_state(opt)
    mine, _ = _heal_state(model, opt, _Position())
    with pytest.raises(RuntimeError, match=r"of 0\.0\.weight holds \['momentum_buffer'\].*same --optimizer.name"):
        mine.load_state_dict(copy.deepcopy(peer.state_dict()))
    assert not torch.equal(model[0].weight, peer_model[0].weight), "weights were copied before the refusal"


def _hook_coverage(rank: int, world_size: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from torchtitan.fault_tolerance.hooks import check_every_parameter_hooked, install_cross_group_hooks

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    fully_shard(model[0], mesh=mesh)  # the second layer sits in no unit: the silent-divergence trap
    errors = []
    try:
        install_cross_group_hooks([model], manager=None)
    except RuntimeError as e:
        errors.append(str(e))
    fully_shard(model, mesh=mesh)
    install_cross_group_hooks([model], manager=None)
    check_every_parameter_hooked([model])  # now every parameter is covered
    return errors


@pytest.mark.slow
def test_a_parameter_outside_every_hooked_unit_is_refused():
    (errors,) = run_ranks(_hook_coverage, 1, timeout=120)
    assert len(errors) == 1
    assert "2 parameter(s) sit in no FSDP unit" in errors[0] and "1.weight" in errors[0], errors


def test_fingerprint_sees_one_flipped_bit_and_a_swap():
    from torchtitan.fault_tolerance.replica_check import fingerprint

    a, b = torch.randn(5, 3), torch.randn(7)
    base = fingerprint([a, b])
    assert fingerprint([a.clone(), b.clone()]) == base
    flipped = a.clone()
    flipped.view(torch.int32).view(-1)[4] ^= 1  # the lowest mantissa bit of one element
    assert fingerprint([flipped, b]) != base
    assert fingerprint([b, a]) != base
    swapped = a.clone().reshape(-1)
    swapped[[0, 1]] = swapped[[1, 0]]
    assert fingerprint([swapped.reshape(5, 3), b]) != base


def _meta_debug_model() -> torch.nn.Module:
    from torchtitan.models.common.decoder import Decoder
    from torchtitan.models.llama3 import llama3_flavors

    with torch.device("meta"):
        return Decoder(llama3_flavors["debugmodel"])


@pytest.mark.parametrize("n", [1, 2, 3, 9])
def test_diloco_fragments_cover_every_parameter_once_in_model_order(n):
    from torchtitan.fault_tolerance.semi_sync import model_fragments

    model = _meta_debug_model()
    fragments = model_fragments([model], n)
    assert len(fragments) == n and all(any(True for _ in f.parameters()) for f in fragments)
    in_fragments = [id(p) for f in fragments for p in f.parameters()]
    assert in_fragments == [id(p) for p in model.parameters()]  # each once, consecutive, in model order
    if n == 2:  # split near half the parameters
        sizes = [sum(p.numel() for p in f.parameters()) for f in fragments]
        assert max(sizes) < 0.75 * sum(sizes), sizes


def test_diloco_fragments_refuse_too_many_fragments_and_an_uncovered_parameter():
    from torchtitan.fault_tolerance.semi_sync import Fragment, check_fragments_cover_model, model_fragments

    model = _meta_debug_model()
    with pytest.raises(ValueError, match="num_fragments=10 exceeds the model's 9 units"):
        model_fragments([model], 10)
    without_output = Fragment([m for name, m in model.named_children() if name != "output"])
    with pytest.raises(RuntimeError, match="output.weight \\(in 0 fragments\\)"):
        check_fragments_cover_model([model], [without_output])


class _QuorumRank:
    """The one thing the checkpoint rule asks torchft's manager: this group's rank in the last quorum."""

    def __init__(self, rank: int):
        self.rank = rank

    def participating_rank(self) -> int:
        return self.rank


@pytest.mark.parametrize("replica_id, started_at, syncs, quorum_rank, writes", [
    (0, 0, 0, 0, True),     # fresh job, before the first sync: group 0 (its state depends on nothing else)
    (1, 0, 0, 0, False),    # ... and no other group
    (0, 12, 0, 0, False),   # resumed (or came back) from a checkpoint: apart from the others until it syncs
    (0, 0, 2, 1, False),    # after a sync: the first group of that sync's quorum, not group 0 as such
    (1, 12, 1, 0, True),
])
def test_semi_sync_checkpoint_writer(replica_id, started_at, syncs, quorum_rank, writes):
    from torchtitan.fault_tolerance.semi_sync_step import SemiSyncStep

    ft_cfg = SimpleNamespace(replica_id=replica_id, num_replica_groups=2, replica_check_freq=0)
    step = SemiSyncStep(None, _QuorumRank(quorum_rank), None, None, ft_cfg, semi_sync_state=None)
    step.started_at, step.syncs = started_at, syncs
    assert step.writes_checkpoint() is writes


def test_startup_wait_decisions():
    """The decision of each quorum of the startup wait (the runs are in test_startup.py): alone = ask again,
    some = compute but do not commit, all / timed out / peers ahead = go, and then never wait again."""
    from types import SimpleNamespace

    from torchtitan.fault_tolerance.startup import GO, HOLD, WAIT, StartupWait

    def quorum(groups: list[int], max_step: int = 0) -> SimpleNamespace:
        return SimpleNamespace(replica_ids=[f"replica_group_{g}:uuid{g}" for g in groups], max_step=max_step)

    timed_out = {"flag": False}
    asked: list[bool] = []

    def agree(flag: bool) -> bool:
        asked.append(flag)
        return timed_out["flag"]

    wait = StartupWait(3, 60, agree)
    assert not wait.done
    assert wait.decide(quorum([1]), 0) == WAIT
    assert wait.decide(quorum([0, 1]), 0) == HOLD and not wait.done
    assert asked == [False, False]  # the group's ranks agreed on the timeout at every undecided quorum
    assert wait.decide(quorum([0, 1, 2]), 0) == GO and wait.done

    late = StartupWait(3, 60, agree)
    assert late.decide(quorum([1], max_step=7), 5) == GO and late.done  # peers ahead: heal, no wait

    timed_out["flag"] = True  # another rank of the group saw the timeout pass: every rank goes
    expired = StartupWait(3, 60, agree)
    assert expired.decide(quorum([2]), 0) == GO and expired.done

    assert StartupWait(2, 0, agree).done  # 0 turns the wait off


def test_semi_sync_refuses_a_manager_that_is_not_torchfts():
    from torchtitan.config.job_config import FaultTolerance
    from torchtitan.fault_tolerance.semi_sync import build_semi_sync

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="semi_sync_method=diloco needs torchft's Manager .* not a SimpleNamespace"):
        build_semi_sync(FaultTolerance(semi_sync_method="diloco"), SimpleNamespace(), [model], optimizer)
