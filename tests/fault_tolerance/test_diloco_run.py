"""DiLoCo across replica groups end to end: one shared run of two one-rank groups (plain ``python``), and a
whole-job restart from its checkpoint. The inner optimizer is Muon (AdamW for the non-matrix parameters), with
one Newton-Schulz step: the run checks the semi-sync machinery around Muon's state (its heal, its checkpoint),
not the orthogonalization (test_ft_runs.py's main run does that), and one step keeps its cost down. The LocalSGD
run trains AdamW.

``semi_sync_method=diloco``, ``sync_steps`` 4 over 2 fragments (a fragment syncs every 2 steps),
a replica check at every sync, checkpoints every 4 steps into one folder:

- after every sync that both groups took, their global state (each fragment's reference
  parameters and outer momentum) is bitwise equal; between syncs no byte crosses groups, and the
  fragments' syncs together send every parameter once per ``sync_steps`` (the figure of
  benchmarks/README.md section 9);
- group 1 is SIGKILLed in the middle of the sync of step 4 (after handing torchft its first
  all-reduce): the survivor's sync fails and is discarded, its global state stays as it was, and
  the same fragment syncs at step 6 (alone); group 1 is started again by hand (from scratch: its
  checkpointing off, so it is behind) and heals at its first sync, taking the survivor's step;
  from then on its global state is bitwise the survivor's after every sync;
- each checkpoint is written by one group and holds the semi-sync state; from step 12 both groups
  restart (a whole-job restart, group 1 2 s after group 0: the startup wait holds group 0's first sync
  for it): they resume at step 13, group 0's step 13 is bitwise its first run's (weights, Muon's momentum
  and AdamW's moments, loss, and the reference parameters and outer momentum from the checkpoint),
  the sync count continues, and the groups are bitwise equal after every sync.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_ft_runs import COMMON, ENTRY, _by_step, _env, _lighthouse, _records, _wait, stop

from torchtitan.models.common.decoder import Decoder
from torchtitan.models.llama3 import llama3_flavors

pytestmark = pytest.mark.slow  # every test here starts processes

STEPS, SYNC, FRAGMENTS, KILL_AT, CKPT_EVERY, RESTART_AT = 16, 4, 2, 4, 4, 12
RESTART_LATE_S = 2.0
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
DUMP_AT = 2  # the first sync, both groups in it: each saves the states around it (ft_entry.py)
CHECK_BYTES = 2 * 2 * 8  # the replica check's table: 2 groups x (fingerprint, present) int64
INNER_MUON = ("--optimizer.name=Muon", "--optimizer.muon_ns_steps=1")


def _param_bytes() -> int:
    """The debug model's parameters in float32, counted from the flavor table (a meta model)."""
    with torch.device("meta"):
        model = Decoder(llama3_flavors["debugmodel"])
    return 4 * sum(p.numel() for p in model.parameters())


def _args(tmp: Path, ckpt: str, address: str) -> list[str]:
    return [*COMMON, *INNER_MUON, f"--training.steps={STEPS}", "--lr_scheduler.warmup_steps=2",
            "--fault_tolerance.enable", "--fault_tolerance.num_replica_groups=2",
            f"--fault_tolerance.lighthouse={address}",
            "--fault_tolerance.semi_sync_method=diloco", f"--fault_tolerance.sync_steps={SYNC}",
            f"--fault_tolerance.outer_lr={OUTER_LR}", f"--fault_tolerance.outer_momentum={OUTER_MOMENTUM}",
            f"--fault_tolerance.num_fragments={FRAGMENTS}", "--fault_tolerance.replica_check_freq=1",
            "--fault_tolerance.timeout_seconds=10", "--comm.train_timeout_seconds=30",
            "--checkpoint.enable_checkpoint", f"--checkpoint.folder={tmp / ckpt}",
            f"--checkpoint.interval={CKPT_EVERY}"]


def _launch(tmp: Path, name: str, g: int, args: list[str], **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, ENTRY, *args, f"--fault_tolerance.replica_id={g}", f"--job.dump_folder={tmp / name}"],
        env=_env(tmp / name, **env), stdout=open(tmp / f"{name}.log", "a"), stderr=subprocess.STDOUT,
        start_new_session=True)


@pytest.fixture(scope="module")
def diloco_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ft_diloco")
    lighthouse, address = _lighthouse(tmp, min_replicas=1)
    (tmp / "start").mkdir()
    args = _args(tmp, "ckpt", address)
    together = {"FT_START_TOGETHER": f"{tmp / 'start'}:2", "FT_DUMP_SYNC_AT_STEP": str(DUMP_AT)}
    procs = {"g0": _launch(tmp, "g0", 0, args, FT_THROTTLE_ALONE="1", **together),
             "g1": _launch(tmp, "g1", 1, args, FT_CRASH_IN_SYNC_AT_STEP=str(KILL_AT), **together)}
    try:
        assert procs["g1"].wait(timeout=90) == -signal.SIGKILL, (tmp / "g1.log").read_text()[-3000:]
        # Started again from scratch (it must not resume from the survivor's checkpoint): it is behind.
        procs["g1"] = _launch(tmp, "g1", 1, [*args, "--checkpoint.enable_checkpoint=false"])
        codes = _wait(procs, tmp, timeout=120)
        shutil.copytree(tmp / "ckpt", tmp / "ckpt_restart")
        restart = [*_args(tmp, "ckpt_restart", address), f"--checkpoint.load_step={RESTART_AT}"]
        # Group 1 restarts 2 s after group 0: the startup wait keeps group 0 from taking its first sync alone.
        restarted = {"r0": _launch(tmp, "r0", 0, restart)}
        time.sleep(RESTART_LATE_S)
        restarted["r1"] = _launch(tmp, "r1", 1, restart)
        codes.update(_wait(restarted, tmp, timeout=90))
    finally:
        stop(lighthouse, procs)
    records = {name: _records(tmp / f"{name}.0") for name in ("g0", "g1", "r0", "r1")}
    logs = {name: (tmp / f"{name}.log").read_text() for name in ("g0", "g1")}
    return tmp, codes, records, logs


def _lives(records: list[dict]) -> tuple[list[dict], list[dict]]:
    first = [r for r in records if r["pid"] == records[0]["pid"]]
    return first, [r for r in records if r["pid"] != records[0]["pid"]]


def test_every_group_finishes(diloco_run):
    tmp, codes, records, _ = diloco_run
    assert codes == {"g0": 0, "g1": 0, "r0": 0, "r1": 0}, (codes, (tmp / "g1.log").read_text()[-3000:])
    assert all("Muon on" in (tmp / f"{name}.log").read_text() for name in codes), "the inner optimizer is not Muon"
    assert [r["step"] for r in records["g0"]] == list(range(1, STEPS + 1))
    first, second = _lives(records["g1"])
    assert [r["step"] for r in first] == list(range(1, KILL_AT))  # killed during step 4
    assert second and second[-1]["step"] == STEPS


def test_global_state_is_bitwise_equal_after_every_joint_sync(diloco_run):
    _, _, records, _ = diloco_run
    survivor = _by_step(records["g0"])
    # Syncs every sync_steps / num_fragments steps, on the same steps in both groups (step 4's discarded).
    every = SYNC // FRAGMENTS
    assert [r["step"] for r in records["g0"] if r["synced"]] == [s for s in range(every, STEPS + 1, every)
                                                                 if s != KILL_AT]
    joint = [r for r in records["g1"] if r["synced"]]
    assert len(joint) >= 4, joint
    for r in joint:
        s = survivor[r["step"]]
        assert r["participants"] == s["participants"] == 2, r
        assert r["syncs"] == s["syncs"] and r["global_state"] == s["global_state"], f"step {r['step']} differs"
    # The inner steps are local: different data, so different weights between syncs.
    first, _ = _lives(records["g1"])
    assert first[0]["state"] != survivor[1]["state"]


def test_the_global_state_changes_at_every_committed_sync(diloco_run):
    """A sync that averaged nothing or took no outer step would leave the reference parameters as they were."""
    _, _, records, _ = diloco_run
    for name in ("g0", "g1", "r0"):
        steps = _by_step(records[name])
        for r in records[name]:
            before = steps.get(r["step"] - 1)
            if before is not None and r["pid"] == before["pid"]:
                assert (r["global_state"] != before["global_state"]) == r["synced"], (name, r["step"])


def _load_dump(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def test_one_sync_is_the_outer_nesterov_step_on_the_averaged_pseudo_gradients(diloco_run):
    """Step 2's sync, recomputed from the states both groups saved around it: for each parameter of the
    synced fragment, pseudo-gradient_g = reference - weights_g, averaged over the groups; the momentum
    buffer m' = momentum x m + average; the new reference = reference - outer_lr x (average + momentum x m')
    (SGD with Nesterov momentum). The other fragment's state is untouched."""
    tmp = diloco_run[0]
    dumps = [_load_dump(tmp / f"g{g}.0.sync.pt") for g in (0, 1)]
    assert all(d["participants"] == 2 and d["synced"] for d in dumps), [(d["participants"], d["synced"]) for d in dumps]
    before, after = dumps[0]["before"], dumps[0]["after"]
    assert set(before["momentum"]) == set(after["momentum"]) == set(before["reference"]), "no outer momentum buffers"
    synced = set(dumps[0]["before_sync"])
    assert synced == set(dumps[1]["before_sync"]) and 0 < len(synced) < len(before["reference"]), sorted(synced)
    for fqn, reference in before["reference"].items():
        for d in dumps[1:]:  # the groups start the sync from the same global state and end it at the same one
            assert torch.equal(d["before"]["reference"][fqn], reference) and torch.equal(d["after"]["reference"][fqn],
                                                                                          after["reference"][fqn]), fqn
        if fqn not in synced:
            assert torch.equal(after["reference"][fqn], reference) and \
                torch.equal(after["momentum"][fqn], before["momentum"][fqn]), fqn
            continue
        pseudo = [reference - d["before_sync"][fqn] for d in dumps]
        assert not torch.equal(pseudo[0], pseudo[1]), fqn  # each group trained on its own data
        average = (pseudo[0] + pseudo[1]) / 2
        momentum = OUTER_MOMENTUM * before["momentum"][fqn] + average
        expected = reference - OUTER_LR * (average + OUTER_MOMENTUM * momentum)
        named = lambda m, fqn=fqn: f"{fqn}: {m}"  # noqa: E731
        torch.testing.assert_close(after["momentum"][fqn], momentum, rtol=1e-5, atol=1e-7, msg=named)
        torch.testing.assert_close(after["reference"][fqn], expected, rtol=1e-5, atol=1e-7, msg=named)


def test_cross_group_bytes_only_at_syncs_every_parameter_once_per_sync_steps(diloco_run):
    _, _, records, _ = diloco_run
    g0 = records["g0"]
    assert all(r["allreduces"] == 0 for r in g0 if r["step"] % (SYNC // FRAGMENTS))
    per_sync = [r["allreduce_bytes"] - CHECK_BYTES for r in g0 if r["synced"]]
    # Fragments alternate (a discarded one is retried); two consecutive syncs carry each parameter once.
    assert all(a + b == _param_bytes() for a, b in zip(per_sync[::2], per_sync[1::2])), per_sync


def test_survivor_syncs_alone_and_the_restarted_group_heals_at_its_first_sync(diloco_run):
    _, _, records, _ = diloco_run
    survivor = _by_step(records["g0"])
    assert any(r["participants"] == 1 and r["synced"] for r in records["g0"]), "survivor never synced alone"
    # The sync group 1 died in was discarded: the reference parameters and outer momentum are untouched,
    # and the same fragment syncs next time.
    failed = survivor[KILL_AT]
    assert failed["discarded"] == 1 and not failed["synced"] and failed["local_step"] == 0, failed
    assert failed["global_state"] == survivor[KILL_AT - 1]["global_state"] and failed["syncs"] == KILL_AT // 2 - 1
    retried = survivor[KILL_AT + 2]
    assert retried["synced"] and retried["participants"] == 1 and retried["syncs"] == failed["syncs"] + 1
    # Fragment 1 again, not fragment 0 (which step 2 synced): its bytes differ from step 2's.
    assert retried["allreduce_bytes"] != survivor[KILL_AT - 2]["allreduce_bytes"]
    assert records["g0"][-1]["discarded"] == 1
    _, second = _lives(records["g1"])
    # Step 1 is an inner step of its own; its first sync (its step 2) heals it to the survivor's step.
    assert second[0]["step"] == 1 and second[0]["heals"] == 0 and not second[0]["synced"]
    healed = second[1]
    assert healed["heals"] == 1 and healed["synced"] and healed["step"] > KILL_AT + 1, healed
    for r in second[1:]:
        if r["synced"]:
            assert r["global_state"] == survivor[r["step"]]["global_state"], f"step {r['step']} after the heal"


def test_one_group_writes_each_checkpoint_with_the_semi_sync_state(diloco_run):
    tmp, _, _, logs = diloco_run
    assert sorted(p.name for p in (tmp / "ckpt").iterdir()) == [f"step-{s}" for s in (12, 16, 4, 8)]
    for step in range(CKPT_EVERY, STEPS + 1, CKPT_EVERY):
        writers = [g for g, log in logs.items() if f"Checkpoint step {step} saved" in log]
        assert len(writers) == 1, f"step {step} written by {writers}"
        manifest = json.loads((tmp / "ckpt" / f"step-{step}" / "checkpoint.json").read_text())
        assert "semi_sync" in manifest["states"], manifest


def test_whole_job_restart_resumes_at_the_saved_step_with_the_outer_state(diloco_run):
    _, _, records, _ = diloco_run
    first = _by_step(records["g0"])
    for name in ("r0", "r1"):
        assert [r["step"] for r in records[name]] == list(range(RESTART_AT + 1, STEPS + 1)), name
    r0 = records["r0"][0]  # an inner step: group 0's own state and data, as in the first run
    f = first[RESTART_AT + 1]
    assert (r0["loss"], r0["state"], r0["global_state"], r0["syncs"]) == \
        (f["loss"], f["state"], f["global_state"], f["syncs"])
    assert records["r1"][0]["global_state"] == f["global_state"]
    for a, b in zip(records["r0"], records["r1"]):
        if a["synced"]:
            assert b["synced"] and a["participants"] == 2 and a["global_state"] == b["global_state"], a["step"]
            assert a["syncs"] == first[a["step"]]["syncs"]  # the sync count continues from the checkpoint


LOCAL_SGD_STEPS, LOCAL_SGD_SYNC, LOCAL_SGD_LATE_S = 4, 2, 5.0


@pytest.fixture(scope="module")
def local_sgd_run(tmp_path_factory):
    """Two one-rank groups under LocalSGD (``sync_steps`` 2), group 1 started 5 s after group 0, and
    ``min_replicas`` 1: group 0's first sync waits for group 1 (the startup wait), so both are in every sync."""
    tmp = tmp_path_factory.mktemp("ft_local_sgd")
    lighthouse, address = _lighthouse(tmp, min_replicas=1)
    args = [*COMMON, f"--training.steps={LOCAL_SGD_STEPS}", "--lr_scheduler.warmup_steps=1",
            "--fault_tolerance.enable", "--fault_tolerance.num_replica_groups=2", "--fault_tolerance.min_replicas=1",
            f"--fault_tolerance.lighthouse={address}", "--fault_tolerance.semi_sync_method=local_sgd",
            f"--fault_tolerance.sync_steps={LOCAL_SGD_SYNC}", "--fault_tolerance.timeout_seconds=10",
            "--comm.train_timeout_seconds=30"]
    try:
        dump = {"FT_DUMP_SYNC_AT_STEP": str(LOCAL_SGD_SYNC)}
        procs = {"g0": _launch(tmp, "g0", 0, args, **dump)}
        time.sleep(LOCAL_SGD_LATE_S)
        procs["g1"] = _launch(tmp, "g1", 1, args, **dump)
        codes = _wait(procs, tmp, timeout=90)
    finally:
        lighthouse.kill()
        lighthouse.wait()
    dumps = [_load_dump(tmp / f"g{g}.0.sync.pt") for g in (0, 1)]
    return codes, {g: _records(tmp / f"{g}.0") for g in ("g0", "g1")}, dumps


def test_local_sgd_averages_the_weights_at_each_sync_and_nothing_between(local_sgd_run):
    codes, records, _ = local_sgd_run
    assert codes == {"g0": 0, "g1": 0}, codes
    g0, g1 = records["g0"], records["g1"]
    assert [r["step"] for r in g0] == [r["step"] for r in g1] == list(range(1, LOCAL_SGD_STEPS + 1))
    for a, b in zip(g0, g1):
        synced = a["step"] % LOCAL_SGD_SYNC == 0
        assert a["synced"] == b["synced"] == synced, a
        if synced:  # the weights themselves, averaged over both groups: bitwise equal
            assert a["participants"] == 2 and a["global_state"] == b["global_state"], a["step"]
            assert a["allreduce_bytes"] == b["allreduce_bytes"] == _param_bytes(), a
        else:  # an inner step on each group's own data: apart, and nothing crossed
            assert a["global_state"] != b["global_state"] and a["loss"] != b["loss"], a["step"]
            assert a["allreduces"] == b["allreduces"] == 0, a


def test_local_sgd_sync_result_is_the_average_of_the_groups_weights(local_sgd_run):
    """Each group's weights as the sync of step 2 began, averaged in the test: both groups end the sync there."""
    _, _, dumps = local_sgd_run
    assert all(d["participants"] == 2 and d["synced"] for d in dumps)
    weights = [d["before_sync"] for d in dumps]
    assert set(weights[0]) == set(weights[1]) == set(dumps[0]["after"]["weights"])
    for fqn, w0 in weights[0].items():
        assert not torch.equal(w0, weights[1][fqn]), fqn  # apart before the sync
        for d in dumps:
            torch.testing.assert_close(d["after"]["weights"][fqn], (w0 + weights[1][fqn]) / 2, rtol=1e-6, atol=1e-8,
                                       msg=lambda m, fqn=fqn: f"{fqn}: {m}")
