"""c10d internals: process groups (timeouts, the default store, every group made so far, the fake
backend's store, building only the groups a rank is in), group names, each group's last collective
(torch's flight recorder), and the private c10d ops."""

from __future__ import annotations

import contextlib
import importlib
import json
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from torchtitan.compat.errors import CompatError, missing

# The backend of the placement-only groups (``unflatten_mesh``'s ``fake`` dims): it moves nothing and
# waits for no peer, so it has no timeout.
FAKE_BACKEND = "fake"


def set_pg_timeout(timeout: timedelta, group: dist.ProcessGroup | None = None) -> bool:
    """Change the collective timeout of an existing process group (``None``: the default group) on every
    backend bound to it, and check that each applies it; False, with nothing to set, for a fake group.

    torch's setter only warns where it sets nothing (a backend it does not know), so the timeout each
    backend applies afterwards is read back: a group left on another timeout is refused, naming it.
    """
    group = _default_group() if group is None else group
    if set(group_timeouts(group)) == {FAKE_BACKEND}:
        return False  # a collective on it returns at once: nothing can time out
    if hasattr(dist, "set_timeout"):  # torch >= 2.14: public; the private one warns that it is deprecated
        dist.set_timeout(timeout, group)  # pyright: ignore[reportAttributeAccessIssue]  (torch >= 2.14 only)
    elif hasattr(distributed_c10d, "_set_pg_timeout"):  # torch 2.11-2.13
        distributed_c10d._set_pg_timeout(timeout, group)
    else:
        raise missing("torch.distributed.set_timeout or distributed_c10d._set_pg_timeout")
    kept = [f"{name} still applies {now.total_seconds():g} s" for name, now in group_timeouts(group).items()
            if now is not None and now != timeout]
    if kept:
        raise CompatError(
            f"process group {group.group_desc} ({group.group_name}): torch {torch.__version__} did not set the "
            f"{timeout.total_seconds():g} s timeout ({', '.join(kept)}); torchtitan/compat/c10d.py set_pg_timeout "
            "needs a way to set it for this backend")
    return True


def group_timeouts(group: dist.ProcessGroup) -> dict[str, timedelta | None]:
    """The collective timeout each backend bound to ``group`` applies now, by backend name (``gloo``, ``nccl``;
    ``fake``: None, it has none). Read from each backend's options (all versions: ``options._timeout``)."""
    if not hasattr(group, "_device_types") or not hasattr(group, "_get_backend"):
        raise missing("ProcessGroup._device_types / ProcessGroup._get_backend")
    timeouts: dict[str, timedelta | None] = {}
    for device in group._device_types:
        backend = group._get_backend(device)
        name = backend.name()
        if name == FAKE_BACKEND:
            timeouts[name] = None
            continue
        timeout = getattr(getattr(backend, "options", None), "_timeout", None)
        if not isinstance(timeout, timedelta):
            raise missing(f"{type(backend).__name__}.options._timeout")
        timeouts[name] = timeout
    return timeouts


def _default_group() -> dist.ProcessGroup:
    group = dist.group.WORLD
    if group is None:
        raise RuntimeError("no default process group: call torch.distributed.init_process_group first")
    return group


def default_store() -> distributed_c10d.Store:
    """The key-value store behind the default process group (a store barrier needs no collective)."""
    if not hasattr(distributed_c10d, "_get_default_store"):
        raise missing("distributed_c10d._get_default_store")
    return distributed_c10d._get_default_store()


def all_process_groups() -> list[dist.ProcessGroup]:
    """Every process group this process has created so far, the default one and every sub-group."""
    world = getattr(distributed_c10d, "_world", None)
    if world is None or not hasattr(world, "pg_map"):
        raise missing("distributed_c10d._world.pg_map")
    return list(world.pg_map)


def flight_recorder_reset_exists() -> bool:
    """Whether c10d has ``_reset_fr_recording_nccl``, which torchft's manager calls after each quorum that
    changes its process group, logging a warning where it is missing."""
    from torch._C import _distributed_c10d

    return hasattr(_distributed_c10d, "_reset_fr_recording_nccl")


def last_collectives() -> list[str]:
    """The last collective this process started on each of its process groups of more than one rank, newest
    first, e.g. ``gloo:all_reduce on mesh_tp (process group 27, ranks [0, 1]) started 2.0 s ago, timeout 2 s``.

    Read from torch's flight recorder, which keeps every group's recent collectives by default (torch >=
    2.6; ``TORCH_FR_BUFFER_SIZE=0`` turns it off, and then this is empty). A collective that times out
    fails with the backend's words only (gloo: "Timed out waiting 2000ms for recv operation"), which do
    not name its group, and gloo's records mark a failed collective complete like any other; but a rank
    stuck on a group starts nothing more on it, so the group it hung on is the one whose last collective
    started about its timeout before the failure.
    """
    dump = getattr(importlib.import_module("torch._C._distributed_c10d"), "_dump_fr_trace_json", None)  # no stub
    if dump is None:
        raise missing("torch._C._distributed_c10d._dump_fr_trace_json")
    groups: dict[str, dist.ProcessGroup] = {str(group.group_name): group for group in all_process_groups()}
    last: dict[str, dict[str, Any]] = {}
    for entry in json.loads(dump(True, False)).get("entries", []):  # oldest first
        if "process_group" not in entry or "time_created_ns" not in entry:
            raise missing("the flight recorder's entry fields 'process_group' and 'time_created_ns'")
        last[entry["process_group"][0]] = entry
    now = time.time_ns()  # the recorder stamps entries with the system clock, in ns since the epoch
    lines = []
    for name, entry in sorted(last.items(), key=lambda item: -item[1]["time_created_ns"]):
        group = groups.get(name)
        if group is not None and group.size() < 2:
            continue  # a collective over one rank waits for no peer
        ranks = f", ranks {dist.get_process_group_ranks(group)}" if group is not None else ""
        age = (now - entry["time_created_ns"]) / 1e9
        timeout = f", timeout {entry['timeout_ms'] / 1000:g} s" if "timeout_ms" in entry else ""
        lines.append(f"{entry.get('profiling_name', 'a collective')} on {entry['process_group'][1]} "
                     f"(process group {name}{ranks}) started {age:.1f} s ago{timeout}")
    return lines


def fake_process_group_store() -> distributed_c10d.Store:
    """A store for ``init_process_group("fake", ...)``, whose collectives return at once and move nothing.

    Importing torch's fake process group registers the "fake" backend; it lives in torch's
    testing internals (all versions).
    """
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as e:
        raise missing("torch.testing._internal.distributed.fake_pg.FakeStore") from e
    return FakeStore()


@contextlib.contextmanager
def member_groups_only() -> Iterator[None]:
    """While building device meshes, create only the process groups this rank belongs to.

    ``DeviceMesh`` calls ``new_group`` for every group of every mesh dim on every rank (a real
    backend needs each rank to join every creation), so one rank of a 16,384-rank world creates
    some 90,000 groups. In a fake world nothing is joined: a group this rank is not in returns
    ``NON_GROUP_MEMBER`` at once, after taking its sequence number as ``new_group`` does, so the
    groups this rank is in keep the names a full build gives them (torch 2.9-2.13:
    ``torch.distributed.device_mesh.new_group``, ``_world.group_count``).
    """
    from torch.distributed import device_mesh

    real = getattr(device_mesh, "new_group", None)
    if real is None or not hasattr(distributed_c10d._world, "group_count"):
        raise missing("torch.distributed.device_mesh.new_group / distributed_c10d._world.group_count")

    def new_group(ranks: list[int] | None = None, **kwargs: Any) -> Any:
        if ranks is not None and dist.get_rank() not in ranks:
            distributed_c10d._world.group_count += 1
            return distributed_c10d.GroupMember.NON_GROUP_MEMBER
        return real(ranks=ranks, **kwargs)

    setattr(device_mesh, "new_group", new_group)  # noqa: B010 - a name the stubs do not export
    try:
        yield
    finally:
        setattr(device_mesh, "new_group", real)  # noqa: B010


def resolve_process_group(group_name: str) -> dist.ProcessGroup:
    """The process group a functional collective names by its group name."""
    try:
        from torch._C._distributed_c10d import _resolve_process_group
    except ImportError as e:
        raise missing("torch._C._distributed_c10d._resolve_process_group") from e
    return _resolve_process_group(cast("distributed_c10d.GroupName", group_name))  # a str NewType in the stubs


def c10d_op(name: str) -> Any:
    """``torch.ops.c10d.<name>.default``, for the private ops (``_allgather_base_``, ``_reduce_scatter_base_``)."""
    packet = getattr(torch.ops.c10d, name, None)
    if packet is None or not hasattr(packet, "default"):
        raise missing(f"torch.ops.c10d.{name}")
    return packet.default


def functional_collective_ops() -> Any:
    """The namespace of the functional collectives' ops, ``torch.ops._c10d_functional`` (all versions)."""
    namespace = torch.ops._c10d_functional
    if not hasattr(namespace, "all_gather_into_tensor"):  # torch.ops makes any namespace; its ops tell
        raise missing("torch.ops._c10d_functional")
    return namespace
