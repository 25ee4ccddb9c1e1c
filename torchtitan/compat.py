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

import contextlib
import importlib
import importlib.metadata
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as functional_collectives  # noqa: F401 - re-exported
from torch.distributed import distributed_c10d

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

__all__ = [
    "CompatError", "REDISTRIBUTE_LOGGER", "all_process_groups",
    "c10d_op", "default_store", "dtensor_local", "fake_process_group_store", "flatten_mesh", "fsdp_storage_hooks",
    "functional_collective_ops", "in_autograd_backward", "member_groups_only", "op_name", "op_schema",
    "resolve_process_group",
    "skip_pipeline_shape_exchange", "storage_id", "in_pipeline_shape_inference", "mark_pipeline_shape_inference",
    "functional_collectives", "fsdp_hooked_parameters", "fsdp_param_groups", "fused_kernel_devices",
    "grouped_mm", "grouped_mm_as_on", "grouped_mm_supported", "in_backward_pass", "install_dtensor_rng_tracker",
    "local_shape_and_global_offset", "lower_right_causal_bias", "semi_sync_local_step",
    "semi_sync_reference", "semi_sync_save_reference", "set_pg_timeout", "set_semi_sync_local_step", "unflatten_mesh",
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


# Private classes and functions used as they are (a base class, a mode), read on first use: where one is
# gone, ``from torchtitan.compat import X`` raises CompatError naming it, and the rest of the package
# still imports. (They stay out of ``__all__``, which lists what the module defines.)
_AS_THEY_ARE = {
    "FakeTensorMode": "torch._subclasses.fake_tensor",
    "TorchDispatchMode": "torch.utils._python_dispatch",
    "tree_flatten": "torch.utils._pytree",
    "unset_fake_temporarily": "torch._subclasses.fake_tensor",
}


def __getattr__(name: str) -> Any:
    if name not in _AS_THEY_ARE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = _AS_THEY_ARE[name]
    try:
        value = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise _missing(f"{module}.{name}") from e
    globals()[name] = value
    return value


# ---------------------------------------------------------------- c10d: process groups


def set_pg_timeout(timeout: timedelta, group: dist.ProcessGroup | None = None) -> None:
    """Change the collective timeout of an existing process group (``None``: the default group)."""
    if hasattr(dist, "set_timeout"):  # torch >= 2.14: public; the private one warns that it is deprecated
        dist.set_timeout(timeout, group)  # pyright: ignore[reportAttributeAccessIssue]  (torch >= 2.14 only)
    elif hasattr(distributed_c10d, "_set_pg_timeout"):  # torch 2.11-2.13
        distributed_c10d._set_pg_timeout(timeout, group)
    else:
        raise _missing("torch.distributed.set_timeout or distributed_c10d._set_pg_timeout")


def default_store() -> distributed_c10d.Store:
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


def fake_process_group_store() -> distributed_c10d.Store:
    """A store for ``init_process_group("fake", ...)``, whose collectives return at once and move nothing.

    Importing torch's fake process group registers the "fake" backend; it lives in torch's
    testing internals (all versions).
    """
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as e:
        raise _missing("torch.testing._internal.distributed.fake_pg.FakeStore") from e
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
        raise _missing("torch.distributed.device_mesh.new_group / distributed_c10d._world.group_count")

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
        raise _missing("torch._C._distributed_c10d._resolve_process_group") from e
    return _resolve_process_group(cast("distributed_c10d.GroupName", group_name))  # a str NewType in the stubs


def c10d_op(name: str) -> Any:
    """``torch.ops.c10d.<name>.default``, for the private ops (``_allgather_base_``, ``_reduce_scatter_base_``)."""
    packet = getattr(torch.ops.c10d, name, None)
    if packet is None or not hasattr(packet, "default"):
        raise _missing(f"torch.ops.c10d.{name}")
    return packet.default


def functional_collective_ops() -> Any:
    """The namespace of the functional collectives' ops, ``torch.ops._c10d_functional`` (all versions)."""
    namespace = torch.ops._c10d_functional
    if not hasattr(namespace, "all_gather_into_tensor"):  # torch.ops makes any namespace; its ops tell
        raise _missing("torch.ops._c10d_functional")
    return namespace


# ---------------------------------------------------------------- DeviceMesh


def unflatten_mesh(mesh: Any, sizes: tuple[int, ...], names: tuple[str, ...], fake: tuple[str, ...] = ()) -> Any:
    """``mesh`` (1-D) split into dims ``names`` of ``sizes``, outermost first; a collective on every rank.

    The result shares ``mesh``'s root, so meshes unflattened from one world compose (FSDP2 with TP,
    HSDP) however they split it. The dims named in ``fake`` get the fake backend: no communicator,
    and a collective over them does nothing, so they are for dims no collective runs over.
    """
    if not hasattr(mesh, "_unflatten"):  # with backend_override: torch 2.13 (checked); tests/test_compat.py probes it
        raise _missing("DeviceMesh._unflatten")
    override = {name: "fake" for name in fake} or None
    return mesh._unflatten(0, tuple(sizes), tuple(names), backend_override=override)


def flatten_mesh(mesh: Any, name: str) -> Any:
    """The dims of ``mesh`` (a slice of a root mesh) as one dim ``name``; a collective on every rank.

    The flattened mesh is kept by its root under ``name``, and its process groups are new ones.
    """
    if not hasattr(mesh, "_flatten"):
        raise _missing("DeviceMesh._flatten")
    return mesh._flatten(mesh_dim_name=name)


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


def dtensor_local(t: Any) -> torch.Tensor:
    """A DTensor's local shard as it is stored, without ``to_local``'s autograd op (inside a dispatch mode)."""
    if not hasattr(t, "_local_tensor"):
        raise _missing("DTensor._local_tensor")
    return t._local_tensor


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
        done = pending.trigger_wait()  # pyright: ignore[reportAttributeAccessIssue] - an AsyncCollectiveTensor
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
    if tensor.requires_grad:
        return _WaitKeepingHistory.apply(tensor)
    return tensor.trigger_wait()  # pyright: ignore[reportAttributeAccessIssue] - checked to be one above


# ---------------------------------------------------------------- FSDP2


def fsdp_param_groups(unit: torch.nn.Module) -> list[Any]:
    """The parameter groups (``FSDPParamGroup``) of one ``fully_shard`` unit."""
    if not hasattr(unit, "_get_fsdp_state"):
        raise _missing("FSDPModule._get_fsdp_state")
    state = cast("FSDPModule", unit)._get_fsdp_state()  # a fully_shard unit (checked above)
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


@contextlib.contextmanager
def fsdp_storage_hooks(on_resize: Callable[[torch.Tensor], None],
                       on_accumulated_grad: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Within it, FSDP2 calls ``on_resize(t)`` after it allocates or frees an unsharded parameter's storage,
    and ``on_accumulated_grad(g)`` after it keeps an unsharded gradient ``g`` between backwards.

    FSDP2 resizes those storages in place, which no op shows a dispatch mode; without gradient sync
    it keeps each unsharded gradient, in the reduce dtype, until the step's one reduce-scatter.
    Patched: the module functions ``_fsdp_param.alloc_storage``/``free_storage`` (and the
    ``_fsdp_param_group`` module's own binding of ``alloc_storage``) and two ``FSDPParam`` methods.
    """
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group
    except ImportError as e:
        raise _missing("torch.distributed.fsdp._fully_shard._fsdp_param / _fsdp_param_group") from e
    cls = getattr(_fsdp_param, "FSDPParam", None)
    for owner, name in ((_fsdp_param, "alloc_storage"), (_fsdp_param, "free_storage"),
                        (_fsdp_param_group, "alloc_storage"), (cls, "to_accumulated_grad_if_needed"),
                        (cls, "accumulate_unsharded_grad_if_needed")):
        if not hasattr(owner, name):
            raise _missing(f"torch.distributed.fsdp._fully_shard.{getattr(owner, '__name__', owner)}.{name}")
    assert cls is not None  # the checks above raised otherwise
    alloc, free = _fsdp_param.alloc_storage, _fsdp_param.free_storage
    to_accumulated, accumulate = cls.to_accumulated_grad_if_needed, cls.accumulate_unsharded_grad_if_needed

    def alloc_and_note(tensor: torch.Tensor) -> None:
        alloc(tensor)
        on_resize(tensor)

    def free_and_note(tensor: torch.Tensor) -> None:
        free(tensor)
        on_resize(tensor)

    def note_accumulated(method: Callable[[Any], None]) -> Callable[[Any], None]:
        def wrapper(self: Any) -> None:
            method(self)
            if self.unsharded_accumulated_grad is not None:
                on_accumulated_grad(self.unsharded_accumulated_grad)
        return wrapper

    # _fsdp_param_group's own binding of alloc_storage (an import, not its export) must be patched too.
    _fsdp_param.alloc_storage = _fsdp_param_group.alloc_storage = alloc_and_note  # pyright: ignore[reportPrivateImportUsage]
    _fsdp_param.free_storage = free_and_note
    cls.to_accumulated_grad_if_needed = note_accumulated(to_accumulated)
    cls.accumulate_unsharded_grad_if_needed = note_accumulated(accumulate)
    try:
        yield
    finally:
        _fsdp_param.alloc_storage = _fsdp_param_group.alloc_storage = alloc  # pyright: ignore[reportPrivateImportUsage]
        _fsdp_param.free_storage = free
        cls.to_accumulated_grad_if_needed, cls.accumulate_unsharded_grad_if_needed = to_accumulated, accumulate


# ---------------------------------------------------------------- pipelining


def skip_pipeline_shape_exchange(schedule: Any) -> None:
    """Make ``schedule``'s first step take every stage as static, with no exchange of shapes over the pp group.

    The schedule's warm-up (``_warmup_p2p``) sends each stage's shapes and votes on whether every
    stage stated them; a stage in ``InferenceMode.STATIC`` (its ``_inference_mode``) uses the
    shapes it was given. A fake process group delivers no numbers, so the dry run skips the warm-up.
    """
    try:
        from torch.distributed.pipelining._utils import InferenceMode
    except ImportError as e:
        raise _missing("torch.distributed.pipelining._utils.InferenceMode") from e
    if not hasattr(schedule, "_warmup_p2p") or not hasattr(InferenceMode, "STATIC"):
        raise _missing(f"{type(schedule).__name__}._warmup_p2p / InferenceMode.STATIC")

    def all_static(stages: list[Any], has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    schedule._warmup_p2p = all_static


# ---------------------------------------------------------------- dispatch and autograd


def op_name(func: Any) -> str:
    """An ``OpOverload``'s op name without namespace or overload (``mm`` for ``aten.mm.default``)."""
    if not hasattr(func, "_opname"):
        raise _missing("OpOverload._opname")
    return func._opname


def op_schema(func: Any) -> torch.FunctionSchema:
    """An ``OpOverload``'s schema: its arguments (with what each may write) and its returns."""
    if not hasattr(func, "_schema"):
        raise _missing("OpOverload._schema")
    return func._schema


def storage_id(storage: torch.UntypedStorage) -> int:
    """An id of the storage itself, the same for every tensor that views it (fake storages too)."""
    if not hasattr(storage, "_cdata"):
        raise _missing("UntypedStorage._cdata")
    return storage._cdata


def in_autograd_backward() -> bool:
    """Whether this thread runs inside an autograd backward pass now."""
    if not hasattr(torch._C, "_current_graph_task_id"):
        raise _missing("torch._C._current_graph_task_id")
    return torch._C._current_graph_task_id() != -1


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


# ---------------------------------------------------------------- torch._grouped_mm (mixture-of-experts)


def grouped_mm(x: torch.Tensor, weight_t: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm``: rows ``offsets[g-1]:offsets[g]`` of ``x [M, K]`` times ``weight_t[g] [K, N]``.

    ``offsets`` is the int32 running sum of the group sizes. Callers check
    ``grouped_mm_supported`` first and keep an exact per-group loop for the rest.
    """
    if not hasattr(torch, "_grouped_mm"):
        raise _missing("torch._grouped_mm")
    return torch._grouped_mm(x, weight_t, offs=offsets)  # pyright: ignore[reportPrivateImportUsage]  (private op)


_GROUPED_MM_PROBED: dict[tuple[str, torch.dtype], bool] = {}


_GROUPED_MM_AS_ON: list[frozenset[torch.dtype]] = []  # innermost last: dtypes assumed to take grouped_mm


@contextlib.contextmanager
def grouped_mm_as_on(dtypes: frozenset[torch.dtype]) -> Iterator[None]:
    """Inside, ``grouped_mm_supported`` answers as a device whose kernel takes exactly ``dtypes``, whatever the
    tensors' device: the planner's dry run prices a GPU (CUDA's kernel: bf16) on fake CPU tensors, and the
    fake kernel takes bf16 only, so the CPU probe's answer would be both wrong and fatal there."""
    _GROUPED_MM_AS_ON.append(frozenset(dtypes))
    try:
        yield
    finally:
        _GROUPED_MM_AS_ON.pop()


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs here, forward and backward (probed once per device type and dtype).

    The op is present from torch 2.8 but had no CPU kernel until 2.9 and takes only some dtypes
    per device (CUDA: bf16 on sm80+), so a small call is the only reliable test; a failure means
    the caller's per-expert loop, never an error. Inside ``grouped_mm_as_on`` its dtypes answer.
    """
    if _GROUPED_MM_AS_ON:
        return dtype in _GROUPED_MM_AS_ON[-1]
    key = (torch.device(device).type, dtype)
    if key not in _GROUPED_MM_PROBED:
        # Probed on real tensors even inside a fake-tensor trace (the planner), whose answer would stick.
        try:
            from torch._subclasses.fake_tensor import unset_fake_temporarily
        except ImportError as e:
            raise _missing("torch._subclasses.fake_tensor.unset_fake_temporarily") from e
        # Own saved-tensor hooks (identity): a first call inside an activation-checkpointed forward
        # must not save the probe's tensors to the checkpoint, whose recompute (probe cached) would not.
        with unset_fake_temporarily(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            _GROUPED_MM_PROBED[key] = _probe_grouped_mm(torch.device(device), dtype)
    return _GROUPED_MM_PROBED[key]


def _probe_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        with torch.enable_grad():
            x = torch.ones(6, 8, device=device, dtype=dtype, requires_grad=True)
            w = torch.ones(2, 8, 8, device=device, dtype=dtype, requires_grad=True)
            offsets = torch.tensor([2, 6], device=device, dtype=torch.int32)
            out = grouped_mm(x, w.transpose(-2, -1), offsets)
            out.backward(torch.ones_like(out))
        return bool(torch.all(out == 8)) and x.grad is not None and w.grad is not None
    except (RuntimeError, NotImplementedError, TypeError):
        return False


# Stages whose shape inference is running now (a count: same-rank stages may nest).
_SHAPE_INFERENCE = [0]
# The PipelineStage methods that run a stage's forward or backward only to learn shapes (2.13, 2.14;
# older releases: one method).
_SHAPE_INFERENCE_METHODS = ("_forward_metadata_inference", "_backward_metadata_inference", "_shape_inference")


def mark_pipeline_shape_inference(stage: Any) -> None:
    """Make ``in_pipeline_shape_inference()`` true while ``stage`` (a ``PipelineStage``) infers its shapes.

    On its first step a schedule runs each stage's forward and backward once on stand-in tensors to
    learn the shapes it exchanges; modules that keep statistics of their forwards (an MoE's token
    counts) must not count those. Wraps this instance's inference methods; the class is left alone.
    """
    found = [name for name in _SHAPE_INFERENCE_METHODS if hasattr(stage, name)]
    if not found:
        raise _missing("PipelineStage._forward_metadata_inference (or _shape_inference)")
    for name in found:
        method = getattr(stage, name)

        def inferring(*args: Any, _method: Any = method, **kwargs: Any) -> Any:
            _SHAPE_INFERENCE[0] += 1
            try:
                return _method(*args, **kwargs)
            finally:
                _SHAPE_INFERENCE[0] -= 1

        setattr(stage, name, inferring)


def in_pipeline_shape_inference() -> bool:
    """Whether a pipeline stage marked by ``mark_pipeline_shape_inference`` is inferring its shapes now."""
    return _SHAPE_INFERENCE[0] > 0


# ---------------------------------------------------------------- autograd engine


def in_backward_pass() -> bool:
    """Whether the autograd engine is running a backward pass on this thread right now.

    Activation checkpointing recomputes a forward inside the backward pass (reentrant or not),
    while the original forward runs outside it, with grad mode on or off; so this, and not
    ``torch.is_grad_enabled()``, tells a recompute from the original forward.
    """
    if not hasattr(torch._C, "_current_graph_task_id"):
        raise _missing("torch._C._current_graph_task_id")
    return torch._C._current_graph_task_id() != -1


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
