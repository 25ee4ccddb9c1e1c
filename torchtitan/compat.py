"""Every private internal of torch and torchft that the project uses, in one place.

torch's and torchft's underscored names carry no promise between releases, so the rest
of the package reaches them only through the functions here. Where versions differ, the
function branches on what the installed version has (the feature, not the version number,
so that a backport or a nightly takes the right path) and names the versions beside each
branch; where an internal is gone, it raises ``CompatError`` naming the internal and the
installed version, instead of an ``AttributeError`` deep inside a step. tests/test_compat.py
exercises each one on the installed torch and torchft, so that an upgrade that moves one
fails there first. Tested versions: docs/versions.md.

This module imports torch only (torchft objects come in as arguments), so every layer
of the package may import it.
"""

from __future__ import annotations

import importlib.metadata
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as functional_collectives  # noqa: F401 - re-exported
from torch.distributed import distributed_c10d

__all__ = [
    "CompatError", "REDISTRIBUTE_LOGGER", "all_process_groups", "default_store",
    "functional_collectives", "fsdp_hooked_parameters", "fsdp_param_groups", "fused_kernel_devices",
    "install_dtensor_rng_tracker", "local_shape_and_global_offset", "lower_right_causal_bias", "semi_sync_local_step",
    "semi_sync_reference", "semi_sync_save_reference", "set_pg_timeout", "set_semi_sync_local_step",
    "wait_async_collective",
]


class CompatError(RuntimeError):
    """An internal of torch or torchft that the project relies on is not where it was."""


def _missing(internal: str, package: str = "torch") -> CompatError:
    try:
        version = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        version = "not installed"
    return CompatError(
        f"{package} {version} has no {internal}, which torchtitan relies on; torchtitan/compat.py needs a branch "
        f"for this version (tested versions: docs/versions.md)")


# ---------------------------------------------------------------- c10d: process groups


def set_pg_timeout(timeout: timedelta, group: dist.ProcessGroup | None = None) -> None:
    """Change the collective timeout of an existing process group (``None``: the default group)."""
    if hasattr(dist, "set_timeout"):  # torch >= 2.14: public; the private one warns that it is deprecated
        dist.set_timeout(timeout, group)
    elif hasattr(distributed_c10d, "_set_pg_timeout"):  # torch 2.11-2.13
        distributed_c10d._set_pg_timeout(timeout, group)
    else:
        raise _missing("torch.distributed.set_timeout or distributed_c10d._set_pg_timeout")


def default_store() -> dist.Store:
    """The key-value store behind the default process group (a store barrier needs no collective)."""
    if not hasattr(distributed_c10d, "_get_default_store"):
        raise _missing("distributed_c10d._get_default_store")
    return distributed_c10d._get_default_store()


def all_process_groups() -> list[dist.ProcessGroup]:
    """Every process group this process has created so far, the default one and every sub-group."""
    world = getattr(distributed_c10d, "_world", None)
    if world is None or not hasattr(world, "pg_map"):
        raise _missing("distributed_c10d._world.pg_map")
    return list(world.pg_map)


# ---------------------------------------------------------------- DTensor

# DTensor's redistribution logger, whose per-step notes the gradient-norm code quiets.
REDISTRIBUTE_LOGGER = "torch.distributed.tensor._redistribute"


def local_shape_and_global_offset(shape: torch.Size | tuple[int, ...], mesh: Any, placements: Any
                                  ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shape of this rank's shard of a global ``shape`` and the global index of its first element."""
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError as e:
        raise _missing("torch.distributed.tensor._utils.compute_local_shape_and_global_offset") from e
    return compute_local_shape_and_global_offset(shape, mesh, placements)


def install_dtensor_rng_tracker(mesh: Any) -> bool:
    """Give DTensor an RNG tracker for ``mesh`` that keeps each rank's own seed; False where DTensor has none.

    DTensor creates its tracker lazily on the first random op, and that default tracker
    broadcasts rank 0's seed over the mesh. Created here with ``run_state_sync=False`` it
    syncs nothing. DTensor has trackers only for accelerator meshes (CPU uses the plain generator).
    """
    import warnings

    from torch.distributed.tensor import _random

    for name in ("_rng_tracker", "is_rng_supported_mesh", "OffsetBasedRNGTracker"):
        if not hasattr(_random, name):
            raise _missing(f"torch.distributed.tensor._random.{name}")
    if mesh.device_type == "cpu":
        return False
    with warnings.catch_warnings():  # it warns, then answers False, for meshes it has no tracker for
        warnings.simplefilter("ignore")
        if not _random.is_rng_supported_mesh(mesh):
            return False
    if _random._rng_tracker is None:
        _random._rng_tracker = _random.OffsetBasedRNGTracker(mesh, run_state_sync=False)
    return True


# ---------------------------------------------------------------- async collectives and torch.compile


class _WaitKeepingHistory(torch.autograd.Function):
    """The waited value of a pending collective's result, as a node of its autograd graph (gradient: identity)."""

    @staticmethod
    def forward(ctx: Any, pending: torch.Tensor) -> torch.Tensor:
        done = pending.trigger_wait()
        return done.view_as(done)  # a fresh tensor object: autograd writes its history onto it

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def wait_async_collective(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or where it is a pending collective's result (``AsyncCollectiveTensor``) its waited value
    as a plain tensor that keeps its autograd history.

    Tensor parallelism's output hooks redistribute with ``async_op=True``, so ``to_local()`` hands
    the next module such a tensor. AOTAutograd in torch 2.13 replaces one that reaches a compiled
    region by ``trigger_wait()``, whose result does not require grad, before tracing: the graph is
    then traced as if the input needed no gradient, and backward breaks in DTensor's redistribute
    (docs/versions.md, "torch.compile and tensor parallelism"). Waiting first costs nothing: the
    compiled region waits on entry anyway. A tensor without autograd history is waited plainly.
    """
    pending = getattr(functional_collectives, "AsyncCollectiveTensor", None)
    if pending is None:
        raise _missing("torch.distributed._functional_collectives.AsyncCollectiveTensor")
    if not isinstance(tensor, pending):
        return tensor
    return _WaitKeepingHistory.apply(tensor) if tensor.requires_grad else tensor.trigger_wait()


# ---------------------------------------------------------------- FSDP2


def fsdp_param_groups(unit: torch.nn.Module) -> list[Any]:
    """The parameter groups (``FSDPParamGroup``) of one ``fully_shard`` unit."""
    if not hasattr(unit, "_get_fsdp_state"):
        raise _missing("FSDPModule._get_fsdp_state")
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)  # torch >= 2.13: a list per unit
    if groups is None:
        if not hasattr(state, "_fsdp_param_group"):  # torch 2.11/2.12: one group or None
            raise _missing("FSDPState._fsdp_param_groups or FSDPState._fsdp_param_group")
        groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
    return list(groups)


def fsdp_hooked_parameters(unit: torch.nn.Module) -> list[torch.Tensor]:
    """The sharded parameters of ``unit`` whose reduced gradients its all-reduce hook sees."""
    hooked: list[torch.Tensor] = []
    for group in fsdp_param_groups(unit):
        if not hasattr(group, "_all_reduce_hook") or not hasattr(group, "fsdp_params"):
            raise _missing("FSDPParamGroup._all_reduce_hook / FSDPParamGroup.fsdp_params")
        if group._all_reduce_hook is not None:
            hooked.extend(fsdp_param.sharded_param for fsdp_param in group.fsdp_params)
    return hooked


# ---------------------------------------------------------------- torch.nn.attention


def lower_right_causal_bias(seq_len_q: int, seq_len_kv: int) -> torch.Tensor:
    """``causal_lower_right(seq_len_q, seq_len_kv)`` without its storage.

    The public factory calls ``CausalBias(variant, seq_len_q, seq_len_kv)``, and the Tensor
    constructor reads those three ints as a shape: each bias then holds an unused float32 storage
    of ``2 * seq_len_q * seq_len_kv`` elements (8 GiB for a 16k-token CP chunk against 256k keys;
    seen on 2.13 and 2.14). Long-context CP builds one per chunk, so a strict-overcommit host
    refuses it. The bias made here sits on an empty storage; SDPA's handling of it reads only the
    variant and the two lengths.
    """
    from torch.nn.attention.bias import CausalBias, CausalVariant

    bias = torch.Tensor._make_subclass(CausalBias, torch.empty(0, dtype=torch.bool))
    CausalBias.__init__(bias, CausalVariant.LOWER_RIGHT, seq_len_q, seq_len_kv)
    return bias


# ---------------------------------------------------------------- torch.optim


def fused_kernel_devices() -> tuple[str, ...]:
    """The device types torch has fused optimizer kernels for (at least CUDA, where the helper is gone)."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:
        return ("cuda",)  # every version has the CUDA kernels; only the list of the others is private
    return tuple(_get_fused_kernels_supported_devices())


# ---------------------------------------------------------------- torchft's LocalSGD / DiLoCo (torchft 0.2)


def _attr(algo: Any, name: str) -> Any:
    if not hasattr(algo, name):
        raise _missing(f"{type(algo).__name__}.{name}", "torchft")
    return getattr(algo, name)


def semi_sync_local_step(algo: Any) -> int:
    """Inner steps since the last sync (0 right after one) of a torchft ``LocalSGD``/``DiLoCo``."""
    return int(_attr(algo, "_local_step"))


def set_semi_sync_local_step(algo: Any, step: int) -> None:
    """Restore the inner-step counter from a checkpoint."""
    _attr(algo, "_local_step")
    algo._local_step = step


def semi_sync_reference(algo: Any, fragment: int, name: str) -> torch.Tensor:
    """A DiLoCo fragment's reference (global) copy of parameter ``name`` (this rank's shard)."""
    fragments = _attr(algo, "_fragments")
    if not hasattr(fragments[fragment], "original_parameters"):
        raise _missing("_StreamingDiLoCoFragment.original_parameters", "torchft")
    return fragments[fragment].original_parameters[name]


def semi_sync_save_reference(algo: Any) -> None:
    """Make DiLoCo's reference parameters the model's current ones."""
    _attr(algo, "_save_parameters")()
