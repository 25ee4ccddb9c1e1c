"""c10d internals: process groups (timeouts, the default store, every group made so far, the fake
backend's store, building only the groups a rank is in), group names, and the private c10d ops."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from torchtitan.compat.errors import missing


def set_pg_timeout(timeout: timedelta, group: dist.ProcessGroup | None = None) -> None:
    """Change the collective timeout of an existing process group (``None``: the default group)."""
    if hasattr(dist, "set_timeout"):  # torch >= 2.14: public; the private one warns that it is deprecated
        dist.set_timeout(timeout, group)  # pyright: ignore[reportAttributeAccessIssue]  (torch >= 2.14 only)
    elif hasattr(distributed_c10d, "_set_pg_timeout"):  # torch 2.11-2.13
        distributed_c10d._set_pg_timeout(timeout, group)
    else:
        raise missing("torch.distributed.set_timeout or distributed_c10d._set_pg_timeout")


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
