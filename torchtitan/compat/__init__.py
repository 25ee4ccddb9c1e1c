"""Every private internal of torch and torchft that the project uses, in one package, a module per subsystem.

torch's and torchft's underscored names carry no promise between releases, so the rest
of the package reaches them only through the functions here. Where versions differ, the
function branches on what the installed version has (the feature, not the version number,
so that a backport or a nightly takes the right path) and names the versions beside each
branch; where an internal is gone, it raises ``CompatError`` naming the internal and the
installed version, instead of an ``AttributeError`` deep inside a step. tests/test_compat.py
exercises each one on the installed torch and torchft, so that an upgrade that moves one
fails there first. Tested versions: docs/versions.md.

The modules: ``c10d`` (process groups, c10d ops), ``mesh`` (DeviceMesh, DTensor), ``compile`` (async
collectives into compiled code), ``fsdp`` (FSDP2), ``pipelining`` (schedules and stages), ``autograd``
(dispatch and the autograd engine), ``checkpointing`` (selective activation checkpointing's modes),
``kernels`` (grouped GEMM, causal bias, fused optimizers),
``dcp`` (distributed checkpointing's fsspec storage and state-dict traversal), ``torchft`` (LocalSGD /
DiLoCo), ``import_noise`` (the warnings torchao's import logs that do not apply,
dropped at their loggers), ``errors`` (``CompatError``). ``from torchtitan.compat import X`` reaches
every function of them.

The package imports torch only (torchft objects come in as arguments), so every layer of the
package may import it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

import torch.distributed._functional_collectives as functional_collectives  # noqa: F401 - re-exported

from torchtitan.compat.autograd import in_autograd_backward, in_backward_pass, op_name, op_schema, storage_id
from torchtitan.compat.c10d import (
    all_process_groups,
    c10d_op,
    default_store,
    fake_process_group_store,
    flight_recorder_reset_exists,
    functional_collective_ops,
    group_timeouts,
    last_collectives,
    member_groups_only,
    resolve_process_group,
    set_pg_timeout,
)
from torchtitan.compat.checkpointing import selective_contexts_without_profiler_markers
from torchtitan.compat.compile import wait_async_collective
from torchtitan.compat.dcp import (
    fsspec_file_system_type,
    fsspec_reader_type,
    fsspec_writer_type,
    set_state_dict_element,
)
from torchtitan.compat.errors import CompatError, missing
from torchtitan.compat.fsdp import fsdp_hooked_parameters, fsdp_param_groups, fsdp_storage_hooks
from torchtitan.compat.import_noise import quiet_import_noise
from torchtitan.compat.kernels import (
    cuda_capability,
    fp8_grouped_mm_missing,
    fp8_grouped_mm_skip_reason,
    fused_kernel_devices,
    grouped_mm,
    grouped_mm_as_on,
    grouped_mm_supported,
    lower_right_causal_bias,
    scaled_grouped_mm_available,
    scaled_mm_supported,
)
from torchtitan.compat.mesh import (
    REDISTRIBUTE_LOGGER,
    dtensor_local,
    flatten_mesh,
    install_dtensor_rng_tracker,
    local_shape_and_global_offset,
    shard_dim,
    unflatten_mesh,
)
from torchtitan.compat.pipelining import (
    in_pipeline_shape_inference,
    mark_pipeline_shape_inference,
    skip_pipeline_shape_exchange,
    split_backward_takes_custom_functions,
    stage_gradient_keywords,
    step_keeping_no_outputs,
    warm_up_other_ranks_only,
)
from torchtitan.compat.torchft import (
    semi_sync_local_step,
    semi_sync_reference,
    semi_sync_save_reference,
    set_semi_sync_local_step,
)

# Before anything imports torchao (only Float8 and the MoE FP8 kernels do, lazily): the warnings its import logs
# that do not apply to the run, dropped by logger and message (compat/import_noise.py says which and why).
quiet_import_noise()

if TYPE_CHECKING:  # what the lazy names below are, for the type checker
    from torch._C._distributed_c10d import TCPStore  # noqa: F401
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily  # noqa: F401
    from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401
    from torch.utils._pytree import tree_flatten  # noqa: F401

__all__ = [
    "CompatError", "REDISTRIBUTE_LOGGER", "all_process_groups",
    "c10d_op", "default_store", "dtensor_local", "fake_process_group_store", "flatten_mesh",
    "flight_recorder_reset_exists", "fsdp_storage_hooks",
    "functional_collective_ops", "group_timeouts", "in_autograd_backward", "last_collectives", "member_groups_only",
    "missing", "op_name", "op_schema",
    "resolve_process_group", "stage_gradient_keywords", "step_keeping_no_outputs",
    "skip_pipeline_shape_exchange", "storage_id", "in_pipeline_shape_inference", "mark_pipeline_shape_inference",
    "functional_collectives", "fsdp_hooked_parameters", "fsdp_param_groups", "fused_kernel_devices",
    "grouped_mm", "grouped_mm_as_on", "grouped_mm_supported", "in_backward_pass", "install_dtensor_rng_tracker",
    "local_shape_and_global_offset", "lower_right_causal_bias", "semi_sync_local_step",
    "semi_sync_reference", "semi_sync_save_reference", "selective_contexts_without_profiler_markers",
    "set_pg_timeout", "set_semi_sync_local_step", "shard_dim",
    "split_backward_takes_custom_functions", "unflatten_mesh", "warm_up_other_ranks_only",
    "wait_async_collective", "cuda_capability", "fp8_grouped_mm_missing", "fp8_grouped_mm_skip_reason",
    "scaled_grouped_mm_available", "scaled_mm_supported",
    "fsspec_file_system_type", "fsspec_reader_type", "fsspec_writer_type", "set_state_dict_element",
]

# Private classes and functions used as they are (a base class, a mode), read on first use: where one is
# gone, ``from torchtitan.compat import X`` raises CompatError naming it, and the rest of the package
# still imports. (They stay out of ``__all__``, which lists what the package defines.) ``TCPStore`` is public as
# ``torch.distributed.TCPStore``, but torch's stubs re-export it without listing it: its defining module is named here.
_AS_THEY_ARE = {
    "FakeTensorMode": "torch._subclasses.fake_tensor",
    "TCPStore": "torch._C._distributed_c10d",
    "TorchDispatchMode": "torch.utils._python_dispatch",
    "tree_flatten": "torch.utils._pytree",
    "unset_fake_temporarily": "torch._subclasses.fake_tensor",
}


def __getattr__(name: str) -> object:
    if name not in _AS_THEY_ARE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = _AS_THEY_ARE[name]
    try:
        value = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise missing(f"{module}.{name}") from e
    globals()[name] = value
    return value
