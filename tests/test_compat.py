"""torchtitan/compat/ on the installed torch and torchft: one test per private internal.

Each test uses the internal the way the project does and checks that it still does what
the project relies on, so that an upgrade that moves or changes one fails here, naming it,
rather than in a training run. The distributed ones share one 2-rank gloo world; the planner's
(torchtitan/planning/) run in this process as one rank of a fake process group, as the dry run does.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import inspect
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from unittest import mock

import pytest
import torch
from dist_harness import run_ranks

from torchtitan import compat
from torchtitan.compat import kernels as compat_kernels


def _probe(name: str, fn: Callable[[], Any], out: dict[str, Any]) -> None:
    """Record what ``fn`` returned, or the error it raised, under ``name``: one failure must not hide the others."""
    try:
        out[name] = ("ok", fn())
    except Exception as e:  # noqa: BLE001 - reported by the test of that internal
        out[name] = ("error", f"{type(e).__name__}: {e}")


def _timeout_takes_effect(rank: int) -> float | None:
    """Shorten a fresh group's timeout to 1 s; rank 0 then waits in a barrier rank 1 never joins.

    Returns rank 0's seconds until the barrier failed (None on rank 1). The group was made
    with a 60 s timeout, so a barrier that fails within seconds shows the new one applies.
    """
    import torch.distributed as dist

    group = dist.new_group([0, 1], timeout=timedelta(seconds=60))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the deprecated private setter must not be the path taken
        compat.set_pg_timeout(timedelta(seconds=1), group)
    store = compat.default_store()
    if rank == 1:
        store.wait(["compat/barrier_done"], timedelta(seconds=120))
        return None
    start = time.monotonic()
    try:
        dist.barrier(group=group)
    except RuntimeError:
        return time.monotonic() - start
    finally:
        store.set("compat/barrier_done", "1")
    raise AssertionError("a barrier that rank 1 never joined returned")


def _group_timeouts() -> dict[str, Any]:
    """A gloo group's timeout as its backend applies it, before and after compat.set_pg_timeout, and a fake
    group's (no timeout: set_pg_timeout leaves it, without torch's warning that it set none)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    group = dist.new_group([0, 1], timeout=timedelta(seconds=60))
    before = compat.group_timeouts(group)
    world = init_device_mesh("cpu", (2,), mesh_dim_names=("world",))
    fake = compat.unflatten_mesh(world, (2, 1), ("fake_x", "fake_y"), fake=("fake_x", "fake_y")).get_group("fake_x")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        set_gloo = compat.set_pg_timeout(timedelta(seconds=5), group)
        set_fake = compat.set_pg_timeout(timedelta(seconds=5), fake)
    # A setter that sets nothing (as torch's does, with a warning, for a backend it does not know) is refused.
    setter = "torch.distributed.set_timeout" if hasattr(dist, "set_timeout") else \
        "torch.distributed.distributed_c10d._set_pg_timeout"
    with mock.patch(setter, lambda *args, **kwargs: None):
        try:
            compat.set_pg_timeout(timedelta(seconds=7), group)
            refused = "not refused"
        except compat.CompatError as e:
            refused = str(e)
    return {"before": before, "after": compat.group_timeouts(group), "set": (set_gloo, set_fake),
            "fake": (fake.size(), compat.group_timeouts(fake)), "refused": refused, "name": group.group_name}


def _store_exchange(rank: int) -> str:
    """Each rank writes its key in the default store and reads the other's."""
    store = compat.default_store()
    store.set(f"compat/key{rank}", f"from rank {rank}")
    return store.get(f"compat/key{1 - rank}").decode()


def _fsdp(mesh: Any) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    model[0].set_all_reduce_hook(lambda reduced: None)
    hooked = {id(p) for p in compat.fsdp_hooked_parameters(model[0])}
    return {"groups_inner": len(compat.fsdp_param_groups(model[0])),
            "groups_root": len(compat.fsdp_param_groups(model)),
            "hooked_inner_is_its_params": hooked == {id(p) for p in model[0].parameters()},
            "hooked_root": len(compat.fsdp_hooked_parameters(model))}


def _shard_offset(rank: int, mesh: Any) -> bool:
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.arange(15.0).reshape(5, 3)
    local = distribute_tensor(full, mesh, [Shard(0)]).to_local()
    shape, offset = compute = compat.local_shape_and_global_offset(full.shape, mesh, [Shard(0)])
    assert tuple(shape) == tuple(local.shape), compute
    return torch.equal(full[offset[0]:offset[0] + shape[0]], local) and offset[1] == 0


def _unflatten_and_flatten(rank: int, world_size: int) -> dict[str, Any]:
    """A (a=2, b=1) mesh from the 1-D world with b on the fake backend, a second split of the same world,
    and a flattened view: what ParallelDims builds."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = init_device_mesh("cpu", (world_size,), mesh_dim_names=("world",))
    first = compat.unflatten_mesh(world, (world_size, 1), ("a", "b"), fake=("b",))
    second = compat.unflatten_mesh(world, (1, world_size), ("c", "d"), fake=("c",))
    flat = compat.flatten_mesh(first["a", "b"], "ab")
    summed = torch.tensor([float(rank + 1)])
    dist.all_reduce(summed, group=flat.get_group())
    return {"first": (first.mesh_dim_names, tuple(first.shape), first.get_coordinate()),
            "second": (second.mesh_dim_names, tuple(second.shape), second.get_coordinate()),
            "one_root": first._get_root_mesh() is second._get_root_mesh() is world,
            "backends": (dist.get_backend(first.get_group("b")), dist.get_backend(second.get_group("d"))),
            "flat": (flat.mesh_dim_names, flat.size(), summed.item())}


def _world_probes(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import _random

    out: dict[str, Any] = {}
    mesh = init_device_mesh("cpu", (world_size,))
    _probe("set_pg_timeout", lambda: _timeout_takes_effect(rank), out)
    _probe("group_timeouts", _group_timeouts, out)
    _probe("default_store", lambda: _store_exchange(rank), out)
    _probe("all_process_groups", lambda: (len(compat.all_process_groups()),
                                          dist.group.WORLD in compat.all_process_groups()), out)
    _probe("fsdp", lambda: _fsdp(mesh), out)
    _probe("unflatten_mesh", lambda: _unflatten_and_flatten(rank, world_size), out)
    _probe("local_shape_and_global_offset", lambda: _shard_offset(rank, mesh), out)
    _probe("dtensor_rng", lambda: (compat.install_dtensor_rng_tracker(mesh), _random._rng_tracker is None), out)
    _probe("functional_collectives", lambda: compat.functional_collectives.all_gather_tensor_autograd(
        torch.tensor([float(rank)]), gather_dim=0, group=dist.group.WORLD).tolist(), out)
    _probe("wait_async_collective", lambda: _wait_async(rank, mesh), out)
    dist.barrier()
    return out


def _wait_async(rank: int, mesh: Any) -> dict[str, Any]:
    """An async TP redistribute's local result, waited by compat.wait_async_collective, and its gradient."""
    from torch.distributed.tensor import DTensor, Partial, Shard

    w = torch.full((1, 4, 2), float(rank + 1), requires_grad=True)
    pending = DTensor.from_local(w * 1, mesh, [Partial()]).redistribute(mesh, [Shard(1)], async_op=True).to_local()
    waited = compat.wait_async_collective(pending)
    (waited * 3).sum().backward()
    plain = torch.ones(2)
    return {"pending": type(pending).__name__, "waited": type(waited) is torch.Tensor,
            "requires_grad": waited.requires_grad, "value": waited.tolist(), "grad": w.grad.tolist(),
            "plain_is_itself": compat.wait_async_collective(plain) is plain}


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return run_ranks(_world_probes, 2, timeout=240)


def _ok(world: list[dict[str, Any]], name: str) -> list[Any]:
    """Each rank's result of probe ``name``; fails naming the internal and the error when one raised."""
    results = []
    for rank, probes in enumerate(world):
        status, value = probes[name]
        assert status == "ok", f"compat.{name} failed on rank {rank} with torch {torch.__version__}: {value}"
        results.append(value)
    return results


@pytest.mark.slow
def test_set_pg_timeout_changes_a_live_groups_timeout(world):
    # torch >= 2.14: torch.distributed.set_timeout; 2.11-2.13: distributed_c10d._set_pg_timeout.
    seconds, _ = _ok(world, "set_pg_timeout")
    assert seconds < 30, (f"a barrier under a 1 s timeout (set by compat.set_pg_timeout) waited {seconds:.0f} s: "
                          "the timeout setter no longer reaches the group's backend")


@pytest.mark.slow
def test_group_timeouts_read_what_each_backend_applies(world):
    # ProcessGroup._device_types / _get_backend, and each backend's options._timeout.
    for got in _ok(world, "group_timeouts"):
        assert got["before"] == {"gloo": timedelta(seconds=60)}, got
        assert got["after"] == {"gloo": timedelta(seconds=5)}, (
            f"compat.set_pg_timeout did not reach the gloo backend's options, or options._timeout moved: {got}")
        assert got["set"] == (True, False) and got["fake"] == (2, {"fake": None}), got
        assert f"({got['name']}): " in got["refused"] and "gloo still applies 5 s" in got["refused"], got["refused"]


@pytest.mark.slow
def test_default_store(world):
    # distributed_c10d._get_default_store (the rank-1 wait in the timeout probe went through it too).
    assert _ok(world, "default_store") == ["from rank 1", "from rank 0"]


@pytest.mark.slow
def test_all_process_groups_lists_every_group(world):
    # distributed_c10d._world.pg_map: the default group, the timeout probe's group and the mesh's.
    for count, has_world in _ok(world, "all_process_groups"):
        assert has_world and count >= 2, "distributed_c10d._world.pg_map no longer lists every process group"


@pytest.mark.slow
def test_fsdp_param_groups_and_all_reduce_hook(world):
    # FSDPModule._get_fsdp_state, FSDPState._fsdp_param_groups (2.11/2.12: _fsdp_param_group),
    # FSDPParamGroup._all_reduce_hook and .fsdp_params.
    for result in _ok(world, "fsdp"):
        assert result["groups_inner"] == 1 and result["groups_root"] == 1, result
        assert result["hooked_inner_is_its_params"], (
            "FSDPParamGroup._all_reduce_hook no longer holds what set_all_reduce_hook sets "
            "(or fsdp_params no longer holds the sharded parameters)")
        assert result["hooked_root"] == 0, "a unit without a hook was reported as hooked"


@pytest.mark.slow
def test_unflatten_and_flatten_mesh(world):
    # DeviceMesh._unflatten (with backend_override) and DeviceMesh._flatten: ParallelDims's meshes.
    for rank, got in enumerate(_ok(world, "unflatten_mesh")):
        assert got["first"] == (("a", "b"), (2, 1), (rank, 0)), got
        assert got["second"] == (("c", "d"), (1, 2), (0, rank)), got
        assert got["one_root"], "meshes unflattened from one world no longer share its root: FSDP2 cannot compose them"
        assert got["backends"] == ("fake", "gloo"), (
            f"DeviceMesh._unflatten's backend_override no longer gives degree-1 dims the fake backend: {got}")
        assert got["flat"] == (("ab",), 2, 3.0), got


@pytest.mark.slow
def test_local_shape_and_global_offset(world):
    # torch.distributed.tensor._utils.compute_local_shape_and_global_offset.
    assert _ok(world, "local_shape_and_global_offset") == [True, True]


@pytest.mark.slow
def test_dtensor_rng_tracker(world):
    # torch.distributed.tensor._random: _rng_tracker, is_rng_supported_mesh, OffsetBasedRNGTracker.
    from torch.distributed.tensor import _random

    for installed, tracker_unset in _ok(world, "dtensor_rng"):
        # A CPU mesh has no tracker: nothing installed, nothing left behind.
        assert installed is False and tracker_unset
    assert "run_state_sync" in inspect.signature(_random.OffsetBasedRNGTracker).parameters, (
        "OffsetBasedRNGTracker no longer takes run_state_sync: the tracker would broadcast rank 0's seed")


@pytest.mark.slow
def test_functional_collectives(world):
    # torch.distributed._functional_collectives (context parallelism's autograd all-gather).
    assert _ok(world, "functional_collectives") == [[0.0, 1.0]] * 2


@pytest.mark.slow
def test_wait_async_collective_keeps_the_gradient(world):
    # torch.distributed._functional_collectives.AsyncCollectiveTensor and its trigger_wait().
    for result in _ok(world, "wait_async_collective"):
        assert result["pending"] == "AsyncCollectiveTensor", "TP's async redistribute no longer gives a pending result"
        assert result["waited"] and result["requires_grad"], result
        assert result["value"] == [[[3.0, 3.0]] * 2], result  # this rank's half of the sequence of 1 + 2
        assert result["grad"] == [[[3.0, 3.0]] * 4], result  # each rank's input gets the full gradient back
        assert result["plain_is_itself"]


def test_redistribute_logger_name():
    module = importlib.import_module(compat.REDISTRIBUTE_LOGGER)
    assert module.logger.name == compat.REDISTRIBUTE_LOGGER, (
        f"DTensor's redistribution no longer logs as {compat.REDISTRIBUTE_LOGGER}: grads.py would not quiet it")


def _logged(logger_name: str, msg: str, args: tuple = (), pathname: str = "x.py") -> bool:
    """Whether a WARNING record of ``logger_name`` passes that logger's filters (compat's import-noise filters)."""
    import logging

    logger = logging.getLogger(logger_name)
    record = logger.makeRecord(logger_name, logging.WARNING, pathname, 1, msg, args, None)
    return bool(logger.filter(record))


def test_import_noise_filters_drop_only_torchao_import_warnings_that_do_not_apply(tmp_path):
    # torchtitan/compat/import_noise.py, put on its loggers by importing torchtitan.compat.
    import enum

    from torchtitan.compat import import_noise

    (tmp_path / "_C_cuda.so").write_bytes(b"\x7fELF" + b"\0" * 64 + b"libc10.so\0libcudart.so.13\0libtorch_cuda.so")
    (tmp_path / "_C_cpu.so").write_bytes(b"\x7fELF" + b"\0" * 64 + b"libc10.so\0libtorch_cpu.so")
    init = str(tmp_path / "__init__.py")  # torchao's package file: its libraries are beside it

    def load_failure(library: str) -> bool:
        return _logged(import_noise.TORCHAO_LOGGER, f"Failed to load {tmp_path / library}: Could not load", (), init)

    cuda_build = torch.backends.cuda.is_built()
    # A CUDA library on a build without CUDA is dropped; any other library's failure shows, and every one with CUDA.
    assert load_failure("_C_cuda.so") is cuda_build
    assert load_failure("_C_cpu.so") and load_failure("../elsewhere/_C_cuda.so")
    assert _logged(import_noise.TORCHAO_TRITON_LOGGER,
                   "Warning: Detected no triton, on systems without Triton certain kernels will not work") is cuda_build
    assert _logged(import_noise.TORCHAO_LOGGER, "another torchao warning", (), init)
    assert _logged(import_noise.TORCHAO_TRITON_LOGGER, "another intmm warning")

    # torch's Enum deprecation: dropped for torchao's enums only.
    theirs, ours = enum.Enum("KernelPreference", "AUTO"), enum.Enum("Ours", "A")
    theirs.__module__ = "torchao.float8.config"
    deprecation = ("%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type. "
                   "Calling register_constant() on Enum subclasses is deprecated")
    assert not _logged(import_noise.PYTREE_LOGGER, deprecation, (theirs,))
    assert _logged(import_noise.PYTREE_LOGGER, deprecation, (ours,))
    assert _logged(import_noise.PYTREE_LOGGER, "another pytree warning: %s", (theirs,))
    import_noise.quiet_import_noise()  # a second call adds no second filter
    assert all(len(logging_filters(name)) == 1 for name in import_noise.import_noise_filters())


def logging_filters(name: str) -> list:
    import logging

    return list(logging.getLogger(name).filters)


def test_lower_right_causal_bias_has_no_storage_and_attends_as_the_public_one():
    """CausalBias on an empty storage: SDPA gives the public factory's result bitwise, forward and backward."""
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    bias = compat.lower_right_causal_bias(4, 12)
    assert bias.untyped_storage().nbytes() == 0, "CausalBias: the storage-free bias holds memory"
    assert causal_lower_right(4, 12).untyped_storage().nbytes() > 0, (
        "torch.nn.attention.bias.causal_lower_right no longer allocates: compat.lower_right_causal_bias can go")
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 8, requires_grad=True) for n in (4, 12, 12))
    results = []
    for mask in (bias, causal_lower_right(4, 12), torch.ones(4, 12, dtype=torch.bool).tril(8)):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        results.append((out, *torch.autograd.grad(out.sum(), (q, k, v))))
    for got, want in zip(results[0], results[1], strict=True):
        assert torch.equal(got, want), "CausalBias: the storage-free bias attends differently"
    torch.testing.assert_close(results[0][0], results[2][0])  # and it is the lower-right causal mask


def test_fused_kernel_devices_include_cpu():
    # torch.utils._foreach_utils._get_fused_kernels_supported_devices; without it only CUDA is fused.
    assert "cpu" in compat.fused_kernel_devices(), (
        "torch.utils._foreach_utils._get_fused_kernels_supported_devices is gone or lists no CPU: "
        "Adam/AdamW on CPU would fall back to the slower foreach path")


def test_tcp_store_is_the_class_torch_distributed_exports():
    # torch._C._distributed_c10d.TCPStore, read on first use: the store lifecycle.py and the FT manager open.
    assert compat.TCPStore is torch.distributed.TCPStore


class _StandInManager:
    """The four calls LocalSGD/DiLoCo make on a torchft Manager outside a sync (no lighthouse needed)."""

    _use_async_quorum = False

    def register_state_dict_fn(self, key: str, load: Callable, save: Callable) -> None:
        self.registered = key

    def disallow_state_dict_read(self) -> None:
        pass

    def allow_state_dict_read(self) -> None:
        pass


def _diloco(sync_every: int = 4):
    from torchft.local_sgd import DiLoCo

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=0.7)
    algo = DiLoCo(_StandInManager(), [model], inner, outer, sync_every=sync_every)
    algo.__enter__()
    return algo, model, inner


def _inner_step(model: torch.nn.Module, inner: torch.optim.Optimizer) -> None:
    model(torch.ones(1, 3)).sum().backward()
    inner.step()
    inner.zero_grad()


def test_torchft_local_step():
    # LocalSGD._local_step / DiLoCo._local_step: torchft's inner-step counter, saved in checkpoints.
    from torchft.local_sgd import LocalSGD

    algo, model, inner = _diloco()
    _inner_step(model, inner)
    assert compat.semi_sync_local_step(algo) == 1, "DiLoCo._local_step no longer counts inner steps"
    compat.set_semi_sync_local_step(algo, 2)
    _inner_step(model, inner)
    assert compat.semi_sync_local_step(algo) == 3, "a restored DiLoCo._local_step is not the counter torchft advances"
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    local_sgd = LocalSGD(_StandInManager(), model, optimizer, sync_every=4).__enter__()
    _inner_step(model, optimizer)
    assert compat.semi_sync_local_step(local_sgd) == 1, "LocalSGD._local_step no longer counts inner steps"


def test_torchft_fragments_and_save_parameters():
    # DiLoCo._fragments[i].original_parameters (the reference copy) and DiLoCo._save_parameters.
    algo, model, inner = _diloco()
    reference = compat.semi_sync_reference(algo, 0, "weight")
    assert torch.equal(reference, model.weight.detach()), "DiLoCo's reference is not the parameters it started from"
    before = reference.clone()
    _inner_step(model, inner)
    assert torch.equal(compat.semi_sync_reference(algo, 0, "weight"), before), "an inner step moved the reference"
    compat.semi_sync_save_reference(algo)
    assert torch.equal(compat.semi_sync_reference(algo, 0, "weight"), model.weight.detach()), (
        "DiLoCo._save_parameters no longer copies the parameters into _fragments[i].original_parameters")


def test_missing_internal_names_itself():
    class NotAnAlgorithm:
        pass

    version = importlib.metadata.version("torchft")
    with pytest.raises(compat.CompatError, match=rf"torchft {version} has no NotAnAlgorithm\._local_step"):
        compat.semi_sync_local_step(NotAnAlgorithm())


def test_dcp_fsspec_storage_and_set_state_dict_element():
    from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemReader, FileSystemWriter

    # the object-store file system, writer and reader that checkpoint/integrity.py and no_pickle.py subclass
    assert issubclass(compat.fsspec_file_system_type(), FileSystemBase)
    assert issubclass(compat.fsspec_writer_type(), FileSystemWriter)
    assert issubclass(compat.fsspec_reader_type(), FileSystemReader)
    root: dict[str, Any] = {"optimizer": {"state": [{"step": 0}]}}
    compat.set_state_dict_element(root, ("optimizer", "state", 0, "step"), 7)
    compat.set_state_dict_element(root, ("model", "w"), 1)
    assert root == {"optimizer": {"state": [{"step": 7}]}, "model": {"w": 1}}


def test_no_module_outside_compat_imports_a_private_torch_module():
    import ast
    from pathlib import Path

    package = Path(compat.__file__).parent.parent
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.parent.name == "compat":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
                names = [f"{node.module}.{a.name}" for a in node.names]  # a private name of a public module too
            found += [f"{path.relative_to(package)}:{node.lineno} {name}" for name in names
                      if name.split(".")[0] == "torch" and any(part.startswith("_") for part in name.split("."))]
    assert not found, "private torch imports outside torchtitan/compat/ (give each a function there): " + \
        ", ".join(found)


def test_shard_dim_reads_shards_and_strided_shards():
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    assert compat.shard_dim(Shard(1)) == 1
    assert compat.shard_dim(_StridedShard(0, split_factor=2)) == 0  # FSDP2 over TP or EP
    assert compat.shard_dim(Replicate()) is None and compat.shard_dim(Partial()) is None


def test_selective_contexts_keep_torch_modes_and_run_profiler_markers_outside_the_counts():
    from torch.utils.checkpoint import CheckpointPolicy, _CachedTorchDispatchMode, _CachingTorchDispatchMode, checkpoint

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    keeping, reusing = compat.selective_contexts_without_profiler_markers(policy)
    assert isinstance(keeping, _CachingTorchDispatchMode) and isinstance(reusing, _CachedTorchDispatchMode)
    runs = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        runs.append(1)
        if len(runs) == 2:  # a marker in the recompute only, as FSDP's hooks open under a pipeline
            with torch.profiler.record_function("recompute only"):
                pass
        return (x @ x).sin()

    x = torch.randn(4, 4, requires_grad=True)
    checkpoint(fn, x, use_reentrant=False,
               context_fn=lambda: compat.selective_contexts_without_profiler_markers(policy)).sum().backward()
    expected = torch.func.grad(lambda t: (t @ t).sin().sum())(x.detach())
    assert len(runs) == 2 and torch.allclose(x.grad, expected)


def test_grouped_mm_runs_on_cpu_and_equals_per_group_products():
    # torch._grouped_mm: the MoE experts' grouped GEMM (CPU kernel from torch 2.9).
    assert compat.grouped_mm_supported(torch.device("cpu"), torch.float32), (
        f"torch {torch.__version__}: torch._grouped_mm no longer runs on CPU in float32; the MoE experts "
        "fall back to their per-expert loop (slower)")
    torch.manual_seed(0)
    x, w = torch.randn(7, 8, requires_grad=True), torch.randn(3, 4, 8, requires_grad=True)
    out = compat.grouped_mm(x, w.transpose(-2, -1), torch.tensor([2, 2, 7], dtype=torch.int32))
    want = torch.cat([x[:2] @ w[0].t(), x[2:7] @ w[2].t()])
    assert torch.equal(out, want), "torch._grouped_mm no longer multiplies rows offs[g-1]:offs[g] by group g"
    from torch._subclasses.fake_tensor import FakeTensorMode

    compat_kernels._GROUPED_MM_PROBED.clear()
    with FakeTensorMode():  # a fake-tensor trace (the planner) must not record a failed probe
        compat.grouped_mm_supported(torch.device("cpu"), torch.float32)
    assert compat_kernels._GROUPED_MM_PROBED[("cpu", torch.float32)], (
        "torch._subclasses.fake_tensor.unset_fake_temporarily no longer lets the probe run on real tensors")


def test_in_backward_pass_tells_a_recompute_from_the_forward():
    # torch._C._current_graph_task_id: -1 outside a backward pass.
    seen = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda grad: seen.append(compat.in_backward_pass()))
    assert not compat.in_backward_pass()
    y.sum().backward()
    assert seen == [True], "torch._C._current_graph_task_id no longer marks a running backward pass"
# ---------------------------------------------------------------- the planner's internals, on a fake world
# The dry run (torchtitan/planning/) runs the trainer's step as one rank of a fake process group under
# FakeTensorMode, and watches it with a dispatch mode. Each test below uses one internal that way.


@pytest.fixture
def fake_world() -> Any:
    """This process as rank 1 of a 4-rank fake process group (compat.fake_process_group_store)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("fake", store=compat.fake_process_group_store(), rank=1, world_size=4)
    try:
        yield init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    finally:
        dist.destroy_process_group()


class _Ops(compat.TorchDispatchMode):
    """Records each op, whether it ran in backward, and the storage ids of its outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[Any, bool, list[int]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        storages = [compat.storage_id(t.untyped_storage())
                    for t in compat.tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        self.seen.append((func, compat.in_autograd_backward(), storages))
        return out


def test_fake_process_group_and_flatten_mesh(fake_world):
    # torch.testing._internal.distributed.fake_pg.FakeStore (the "fake" backend) and DeviceMesh._flatten.
    import torch.distributed as dist

    flat = compat.flatten_mesh(fake_world, "ab")
    assert flat.mesh_dim_names == ("ab",) and flat.size() == 4, "DeviceMesh._flatten no longer makes a 1-D mesh"
    assert dist.get_process_group_ranks(flat.get_group()) == [0, 1, 2, 3]
    t = torch.ones(3)
    dist.all_reduce(t, group=flat.get_group())  # the fake backend returns at once and moves nothing
    assert t.tolist() == [1.0, 1.0, 1.0]


def test_member_groups_only_makes_this_ranks_groups_under_their_own_names():
    # torch.distributed.device_mesh.new_group and distributed_c10d._world.group_count: the dry run's meshes
    # create only the groups of the simulated rank, named as a full build names them.
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    def groups(shim: bool) -> tuple[list[tuple[Any, list[int]]], int]:
        dist.init_process_group("fake", store=compat.fake_process_group_store(), rank=5, world_size=8)
        try:
            with compat.member_groups_only() if shim else contextlib.nullcontext():
                mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("a", "b", "c"))
            mine = [(g.group_name, dist.get_process_group_ranks(g)) for g in mesh.get_all_groups()]
            return mine, distributed_c10d._world.group_count
        finally:
            dist.destroy_process_group()

    from torch.distributed import distributed_c10d

    (full, numbered_full), (shim, numbered_shim) = groups(False), groups(True)
    assert shim == full and [r for _, r in shim] == [[1, 5], [5, 7], [4, 5]]
    assert numbered_shim == numbered_full  # every group of the full build took its number


def test_collective_ops_and_resolve_process_group(fake_world):
    # torch.ops.c10d._allgather_base_ / _reduce_scatter_base_ and torch.ops._c10d_functional (the ops the
    # planner's traffic ledger counts), and torch._C._distributed_c10d._resolve_process_group.
    import torch.distributed as dist

    group = fake_world.get_group("b")
    ops = _Ops()
    with ops, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the calls the project's code makes, deprecated or not
        dist.all_gather_into_tensor(torch.empty(4), torch.ones(2), group=group)
        dist.reduce_scatter_tensor(torch.empty(2), torch.ones(4), group=group)
        compat.functional_collectives.all_gather_tensor_autograd(torch.ones(2), 0, group).wait()
    funcs = [func for func, _, _ in ops.seen]
    assert compat.c10d_op("_allgather_base_") in funcs, "all_gather_into_tensor no longer issues c10d._allgather_base_"
    assert compat.c10d_op("_reduce_scatter_base_") in funcs, (
        "reduce_scatter_tensor no longer issues c10d._reduce_scatter_base_")
    gather = compat.functional_collective_ops().all_gather_into_tensor.default
    assert gather in funcs, "the functional all-gather is no longer torch.ops._c10d_functional.all_gather_into_tensor"
    assert compat.resolve_process_group(group.group_name) is group, (
        "_resolve_process_group no longer maps a group name to its process group")


def test_fake_tensors_dispatch_mode_and_backward():
    # torch._subclasses.fake_tensor.FakeTensorMode, torch.utils._python_dispatch.TorchDispatchMode,
    # torch.utils._pytree.tree_flatten, OpOverload._opname, UntypedStorage._cdata, torch._C._current_graph_task_id.
    ops = _Ops()
    with compat.FakeTensorMode(allow_non_fake_inputs=True), ops:
        x = torch.randn(8, 4, requires_grad=True)
        w = torch.randn(4, 2, requires_grad=True)
        (x @ w).sum().backward()
        same = compat.storage_id(x.untyped_storage()) == compat.storage_id(x.view(32).untyped_storage())
        other = compat.storage_id(x.untyped_storage()) != compat.storage_id(w.untyped_storage())
    assert type(x).__name__ == "FakeTensor", "FakeTensorMode no longer makes fake tensors"
    assert same and other, "UntypedStorage._cdata no longer identifies a storage across its views"
    mm = torch.ops.aten.mm.default
    assert compat.op_name(mm) == "mm" and compat.op_name(compat.c10d_op("_allgather_base_")) == "_allgather_base_"
    phases = {(compat.op_name(func), backward) for func, backward, _ in ops.seen if func == mm}
    assert phases == {("mm", False), ("mm", True)}, (
        f"torch._C._current_graph_task_id no longer tells forward from backward: {phases}")
    assert not compat.in_autograd_backward()


def test_op_schema_tells_in_place_updates_from_out_buffers():
    # OpOverload._schema: which arguments an op writes, which are keyword-only, what it returns.
    update = compat.op_schema(torch.ops.aten._foreach_mul_.Scalar)
    assert not update.returns and [a.name for a in update.arguments if a.alias_info and a.alias_info.is_write] == [
        "self"], "the foreach update no longer marks its tensors as written in its schema"
    (out,) = [a for a in compat.op_schema(torch.ops.aten.add.out).arguments if a.name == "out"]
    assert out.kwarg_only and out.alias_info.is_write, "an out= buffer is no longer a written keyword-only argument"


def test_dtensor_local(fake_world):
    # DTensor._local_tensor: the shard as stored, read inside a dispatch mode.
    from torch.distributed.tensor import Shard, distribute_tensor

    # Under the fake process group the scatter leaves the shard's memory as allocated (it may hold NaN
    # left by an earlier test), so the check is that it is the very shard to_local() views, not its values.
    dt = distribute_tensor(torch.arange(8.0), fake_world["b"], [Shard(0)])
    local = compat.dtensor_local(dt)
    assert local.data_ptr() == dt.to_local().data_ptr() and local.shape == (4,)


def test_fsdp_storage_hooks_see_gathers_frees_and_accumulated_gradients(fake_world):
    # torch.distributed.fsdp._fully_shard: _fsdp_param.alloc_storage / free_storage,
    # _fsdp_param_group.alloc_storage, FSDPParam.to_accumulated_grad_if_needed /
    # accumulate_unsharded_grad_if_needed and .unsharded_accumulated_grad.
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    before = (_fsdp_param.alloc_storage, _fsdp_param.free_storage, _fsdp_param_group.alloc_storage)
    model = torch.nn.Linear(4, 4, bias=False)
    fully_shard(model, mesh=compat.flatten_mesh(fake_world, "ab"),
                mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    model.set_requires_gradient_sync(False)  # as under PP micro-batches: the unsharded gradient is kept
    sizes: list[int] = []
    kept: list[torch.dtype] = []
    after_each: list[int] = []
    with compat.fsdp_storage_hooks(on_resize=lambda t: sizes.append(t.untyped_storage().nbytes()),
                                   on_accumulated_grad=lambda g: kept.append(g.dtype)):
        for _ in range(2):
            model(torch.ones(2, 4)).sum().backward()
            after_each.append(len(kept))
    assert 32 in sizes and 0 in sizes, (
        f"FSDP2 no longer allocates and frees unsharded storages through alloc_storage/free_storage: {sizes}")
    assert 0 < after_each[0] < after_each[1] and set(kept) == {torch.float32}, (
        f"FSDPParam's accumulated-gradient methods no longer keep the unsharded gradient in the reduce dtype: {kept}")
    assert (_fsdp_param.alloc_storage, _fsdp_param.free_storage, _fsdp_param_group.alloc_storage) == before


@pytest.mark.parametrize("stage_index", [0, 1])
def test_skip_pipeline_shape_exchange_makes_every_stage_static(fake_world, stage_index):
    # From torch 2.13 the schedules' _warmup_p2p, torch.distributed.pipelining._utils.InferenceMode.STATIC, a stage's
    # _inference_mode; on 2.11 a stage's inputs_meta, _get_init_p2p_neighbors_ops and _validate_fwd_input (which
    # compares strides too: the first stage's micro-batches here are a view, as a batch's token ids are); the
    # gradient keywords of PipelineStage that 2.13 has and 2.11 has not.
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    group = fake_world.get_group("b")  # 2 stages; this process is the last's rank, and stands in for the first's
    grads = compat.stage_gradient_keywords(torch.empty(1, 4) if stage_index else None, torch.empty(1, 4))
    stage = PipelineStage(torch.nn.Linear(4, 4), stage_index, 2, torch.device("cpu"), input_args=torch.empty(1, 4),
                          output_args=torch.empty(1, 4), group=group, **grads)
    schedule = ScheduleGPipe(stage, 2, loss_fn=lambda out, target: out.sum())
    compat.skip_pipeline_shape_exchange(schedule)
    losses: list[torch.Tensor] = []
    if stage_index == 0:
        schedule.step(torch.ones(2, 5)[:, :4])  # a fake recv delivers no shapes to exchange
    else:
        schedule.step(target=torch.zeros(2, 4), losses=losses)
        assert len(losses) == 2
    if hasattr(schedule, "_warmup_p2p"):
        from torch.distributed.pipelining._utils import InferenceMode

        assert stage._inference_mode == InferenceMode.STATIC
    else:  # torch 2.11: the stated shapes stand (no shape inference) and the warm-up sends nothing
        assert stage._get_init_p2p_neighbors_ops() == [] and stage.inputs_meta is not None


def test_warm_up_other_ranks_only_drops_the_messages_to_this_rank(fake_world):
    # PipelineStage._get_init_p2p_neighbors_ops (torch 2.11's multi-stage warm-up), P2POp.group_peer.
    from torch.distributed.pipelining import PipelineStage, ScheduleZBVZeroBubble

    group = fake_world.get_group("b")  # pp rank 1 of 2 holds stages 1 and 2 of the V: 0 1 | 2 3 on ranks 0 1 | 1 0
    stages = [PipelineStage(torch.nn.Linear(4, 4), i, 4, torch.device("cpu"), input_args=torch.empty(1, 4),
                            output_args=torch.empty(1, 4), group=group) for i in (1, 2)]
    ScheduleZBVZeroBubble(stages, 2, loss_fn=lambda out, target: out.sum())  # tells each stage where the others are
    for stage in stages:
        compat.warm_up_other_ranks_only(stage)
    # Each stage's neighbour on pp rank 0 (stage 0, stage 3) gets a send and a receive; gloo has no pair to itself.
    assert [[op.group_peer for op in stage._get_init_p2p_neighbors_ops()] for stage in stages] == [[0, 0], [0, 0]]


def test_split_backward_takes_custom_functions_as_the_onednn_linear_finds():
    # torch.distributed.pipelining._backward.stage_backward_input / stage_backward_weight, the zero-bubble schedules'
    # input and weight passes, through the project's oneDNN linear (a custom autograd function): torch 2.11 fails it.
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from torchtitan.ops.cpu_kernels import OneDNNLinear, onednn_available

    if not onednn_available():
        pytest.skip("this torch build has no oneDNN linear")  # nothing of the project's to split then
    linear = OneDNNLinear(4, 4)
    x = torch.ones(2, 4, requires_grad=True)
    _, groups = stage_backward_input([linear(x)], [torch.ones(2, 4)], [x], linear.parameters())
    try:
        stage_backward_weight(linear.parameters(), groups)
        took = linear.weight.grad is not None
    except RuntimeError:
        took = False
    assert compat.split_backward_takes_custom_functions() == took
