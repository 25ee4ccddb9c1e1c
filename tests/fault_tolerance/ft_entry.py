"""``train.py`` for the fault-tolerance tests: records every committed step, and can crash or throttle.

After each committed step every rank appends one JSON line to ``$FT_RECORD.<rank>``: the
step, when it began and when it was committed, the exact loss, the torchft all-reduces it took (and their bytes), a
hash of this rank's weights, Adam state and learning rate, the groups that took part, and how many steps it discarded
and heals it took so far. Under DiLoCo/LocalSGD also whether the step ended with a committed sync, the syncs so far,
and a hash of the global state (DiLoCo's reference parameters and outer momentum; LocalSGD's weights).

- ``$FT_CRASH_AT_STEP=N``: on torchrun's first round, the group's last rank SIGKILLs itself
  right after committing step N, once every rank has recorded it (one rank crashing: torchrun
  stops the group's other ranks, and its ``--max-restarts`` brings the group back).
- ``$FT_CRASH_IN_SYNC_AT_STEP=N``: on torchrun's first round, the process SIGKILLs itself in the middle of
  step N's cross-group all-reduces (after handing torchft the first one), so the other groups' sync fails.
- ``$FT_CORRUPT_AT_STEP=N``: rank 0 nudges one of its weights as step N begins (silent data
  corruption in one group), which the replica check must catch.
- ``$FT_SLOW_RESTARTED_RANK0=S``: after a torchrun restart, rank 0 waits S seconds before
  creating its torchft manager, so the other ranks look up the manager's address first: with
  a dead manager's address left in torchrun's store they would take that one.
- ``$FT_START_TOGETHER=DIR:N``: on torchrun's first round, wait before the first step until N
  ranks (of all groups) got there, so that no group trains a step alone while another still
  starts up.
- ``$FT_DUMP_SYNC_AT_STEP=N``: under DiLoCo/LocalSGD, at step N (its first life only) the process saves
  ``$FT_RECORD.sync.pt``: this group's weights just before the sync (after its inner step), and
  the global state (DiLoCo's reference parameters and outer momentum; LocalSGD's weights) before
  and after the step, each keyed by FQN, with the FQNs the sync covered and the groups in it.
- ``$FT_DUMP_GRADS_AT_STEP=N``: on torchrun's first round, at step N (its first try), once the step's
  gradients are reduced (within the group and across the groups) and before clipping, rank 0 saves
  them whole, by FQN, to ``$FT_RECORD.<rank>.grads.pt``.
- ``$FT_THROTTLE_ALONE=S``: sleep S seconds after each step committed without another
  group, so that a survivor is still training when the dead group comes back.
- ``$FT_PAUSE_AFTER_STEP=N:PATH``: after committing step N, wait until PATH exists (another
  group's ``$FT_MARK_FIRST_STEP``), so that this group is still training when that one comes.
- ``$FT_MARK_FIRST_STEP=PATH``: create PATH as the first step begins (before its quorum).

The recording and the faults are the trainer's step callbacks (``torchtitan/train_step/callbacks.py``):
at ``STEP_START``, ``GRADIENTS_READY`` and ``STEP_END``. torchft's own manager is instrumented where no
step point reaches (its all-reduces counted, its construction delayed, its sync's inputs captured).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from torchtitan.compat import semi_sync_local_step
from torchtitan.train_step.callbacks import StepCallback, StepEvent, StepPoint

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _local_bytes(t: torch.Tensor) -> bytes:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def state_hash(parts, optimizer: bool = True, lr: bool = True) -> str:
    """A hash of this rank's shards of the weights and of Adam's state, and of the learning rate (``parts``: the
    step's ``StepParts``; ``lr=False`` leaves the learning rate out, which a skipped step still moves on)."""
    h = hashlib.sha256()
    for part in parts.model_parts:
        for name, p in part.named_parameters():
            h.update(name.encode())
            h.update(_local_bytes(p))
            for key, value in sorted(parts.optimizer.state[p].items()) if optimizer else ():
                h.update(key.encode())
                h.update(_local_bytes(value))
    if lr:
        h.update(repr([g["lr"] for g in parts.optimizer.param_groups]).encode())
    return h.hexdigest()


def global_hash(ft) -> str:
    """A hash of this rank's shards of the state a sync makes equal in every group."""
    h = hashlib.sha256()
    for t in ft.semi_sync_state.reference_tensors():
        h.update(_local_bytes(t))
    return h.hexdigest()


def _slow_restarted_rank0(seconds: float) -> None:
    import torchft.manager

    real_init = torchft.manager.Manager.__init__

    def init(self, *args, **kwargs):
        time.sleep(seconds)
        real_init(self, *args, **kwargs)

    torchft.manager.Manager.__init__ = init


def _wait_for_group_records(step: int, timeout: float = 30.0) -> None:
    """Until every rank of this group has recorded ``step``."""
    files = [Path(f"{os.environ['FT_RECORD']}.{r}") for r in range(int(os.environ.get("WORLD_SIZE", "1")))]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(f.exists() and f'"step": {step},' in f.read_text() for f in files):
            return
        time.sleep(0.02)


def _wait_for_file(path: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def _global_state(ft) -> dict[str, dict[str, torch.Tensor]]:
    """By FQN: DiLoCo's reference parameters and outer momentum; LocalSGD's weights (its global state)."""
    semi = ft.semi_sync_state
    if not semi.outers:
        return {"weights": {fqn: _local(p) for fqn, p, _, _ in semi.entries}}
    return {"reference": {fqn: _local(semi._reference(i, name)) for fqn, p, i, name in semi.entries},
            "momentum": {fqn: _local(semi.outers[i].state[p]["momentum_buffer"]) for fqn, p, i, _ in semi.entries
                         if "momentum_buffer" in semi.outers[i].state[p]}}


def _capture_before_sync(dump: dict) -> None:
    """Record, when torchft is about to sync, the weights it syncs (by FQN) as this group holds them."""
    from torchft.local_sgd import LocalSGD, _StreamingDiLoCoFragment

    def capture(params) -> None:
        if dump.get("armed"):
            fqn = dump["fqn"]
            dump["before_sync"] = {fqn[id(p)]: _local(p) for p in params}

    real_prepare, real_average = _StreamingDiLoCoFragment.prepare_sync, LocalSGD._average

    def prepare_sync(self):
        capture(self._model_fragment.parameters())
        return real_prepare(self)

    def average(self):
        capture(self._model.parameters())
        return real_average(self)

    _StreamingDiLoCoFragment.prepare_sync, LocalSGD._average = prepare_sync, average


def _dump_gradients(step: int, path: Path) -> StepCallback:
    """At ``GRADIENTS_READY`` of ``step`` (its first try): save the reduced, unclipped gradients (rank 0)."""
    done: list[bool] = []

    def callback(event: StepEvent) -> None:
        if event.point is not StepPoint.GRADIENTS_READY or event.step != step or done:
            return
        done.append(True)
        grads = {name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
                 for part in event.strategy.parts.model_parts for name, p in part.named_parameters()}
        if os.environ.get("RANK", "0") == "0":
            torch.save(grads, path)

    return callback


class _Recorder:
    """The step callbacks of this entry: record every committed step; inject the faults the environment asks for."""

    def __init__(self) -> None:
        env = os.environ
        self.record = Path(f"{env['FT_RECORD']}.{env.get('RANK', '0')}")
        self.first_round = env.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        self.crash_at = int(env.get("FT_CRASH_AT_STEP", "0"))
        self.crash_in_sync = int(env.get("FT_CRASH_IN_SYNC_AT_STEP", "0"))
        self.throttle = float(env.get("FT_THROTTLE_ALONE", "0"))
        self.together = env.get("FT_START_TOGETHER")
        self.corrupt_at = int(env.get("FT_CORRUPT_AT_STEP", "0"))
        pause_at, _, self.pause_path = env.get("FT_PAUSE_AFTER_STEP", "0:").partition(":")
        self.pause_at = int(pause_at)
        self.mark = env.get("FT_MARK_FIRST_STEP")
        self.dump_at = int(env.get("FT_DUMP_SYNC_AT_STEP", "0"))
        self.dump_file, self.dump = Path(f"{self.record}.sync.pt"), {}
        if self.dump_at:
            _capture_before_sync(self.dump)
        self.calls = {"n": 0, "bytes": 0, "step": 0}
        self.dumping, self.began = False, 0.0

    def __call__(self, event: StepEvent) -> None:
        if event.point is StepPoint.STEP_START:
            self.step_start(event)
        elif event.point is StepPoint.STEP_END:
            self.step_end(event)

    def counting(self, real_allreduce):
        calls = self.calls

        def allreduce(tensor, *args, **kwargs):
            if self.first_round and calls["step"] == self.crash_in_sync and calls["n"] == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            calls["n"] += 1
            calls["bytes"] += tensor.numel() * tensor.element_size()
            return real_allreduce(tensor, *args, **kwargs)
        return allreduce

    def step_start(self, event: StepEvent) -> None:
        ft = _fault_tolerant(event)
        if ft is not None and not self.calls.get("wrapped"):
            ft.manager.allreduce = self.counting(ft.manager.allreduce)
            self.calls["wrapped"] = True
        self.calls.update(n=0, bytes=0, step=event.step)
        if event.step == self.corrupt_at and os.environ.get("RANK", "0") == "0":
            with torch.no_grad():
                p = next(event.strategy.parts.model_parts[0].parameters())
                (p.to_local() if isinstance(p, DTensor) else p).view(-1)[0] += 1e-3
        if self.together and self.first_round:
            folder, count = self.together.rsplit(":", 1)
            Path(folder, f"{getattr(ft, 'replica_id', 0)}.{os.environ.get('RANK', '0')}").touch()
            while len(list(Path(folder).iterdir())) < int(count):
                time.sleep(0.05)
            self.together = None
        if self.mark:
            Path(self.mark).touch()
        semi = getattr(ft, "semi_sync_state", None)
        self.dumping = event.step == self.dump_at and semi is not None and not self.dump_file.exists()
        if self.dumping:
            self.dump.update(armed=True, fqn={id(p): fqn for fqn, p, _, _ in semi.entries}, before=_global_state(ft))
        self.began = time.time()

    def step_end(self, event: StepEvent) -> None:
        ft, out, parts = _fault_tolerant(event), event.output, event.strategy.parts
        if self.dumping:
            torch.save({"before": self.dump["before"], "before_sync": self.dump["before_sync"],
                        "after": _global_state(ft), "participants": ft.participants, "synced": ft.synced},
                       self.dump_file)
            self.dump["armed"] = False
        line = {"step": out.step, "loss": float(out.loss), "state": state_hash(parts),
                "weights_and_moments": state_hash(parts, lr=False), "began": self.began,
                "time": time.time(),
                "participants": ft.participants if ft else 1, "discarded": ft.discarded if ft else 0,
                "heals": ft.heals if ft else 0, "allreduces": self.calls["n"], "allreduce_bytes": self.calls["bytes"],
                "restart": os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"), "pid": os.getpid()}
        semi_sync = getattr(ft, "semi_sync_state", None)
        if semi_sync is not None:
            line.update(synced=ft.synced, syncs=ft.manager.current_step(),
                        local_step=semi_sync_local_step(semi_sync.algo),
                        global_state=global_hash(ft) if semi_sync.outers else state_hash(parts, optimizer=False))
        with self.record.open("a") as f:
            f.write(json.dumps(line) + "\n")
        if self.first_round and out.step == self.crash_at:
            _wait_for_group_records(self.crash_at)  # torchrun stops the others as soon as one rank dies
            if int(os.environ.get("RANK", "0")) == int(os.environ.get("WORLD_SIZE", "1")) - 1:
                os.kill(os.getpid(), signal.SIGKILL)
        if event.step == self.pause_at:
            _wait_for_file(Path(self.pause_path))
        if self.throttle and ft is not None and ft.participants == 1:
            time.sleep(self.throttle)


def _fault_tolerant(event: StepEvent):
    """The fault-tolerant step running ``event``'s step; None in a plain run."""
    return event.strategy if hasattr(event.strategy, "manager") else None


def callbacks() -> list[StepCallback]:
    """This entry's step callbacks (and the torchft instrumentation that no step point reaches)."""
    restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
    if "FT_SLOW_RESTARTED_RANK0" in os.environ and restarted and os.environ.get("RANK") == "0":
        _slow_restarted_rank0(float(os.environ["FT_SLOW_RESTARTED_RANK0"]))
    out: list[StepCallback] = [_Recorder()]
    if "FT_DUMP_GRADS_AT_STEP" in os.environ and not restarted:  # a restarted group's step 1 is a heal
        record = Path(f"{os.environ['FT_RECORD']}.{os.environ.get('RANK', '0')}")
        out.insert(0, _dump_gradients(int(os.environ["FT_DUMP_GRADS_AT_STEP"]), Path(f"{record}.grads.pt")))
    return out


if __name__ == "__main__":
    if "FT_PIDS" in os.environ:  # torchrun starts workers in sessions of their own: the test kills them by pid
        Path(os.environ["FT_PIDS"], str(os.getpid())).touch()
    import train

    sys.exit(train.main(sys.argv[1:], callbacks()))
