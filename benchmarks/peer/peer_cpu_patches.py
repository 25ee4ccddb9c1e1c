"""Run-time workarounds that let the peer (``torchtitan`` 0.3.0 from PyPI) train on CPU with gloo.

Loaded by ``peer_torchtitan.py`` inside the peer's own process, by file path (the project's
checkout is off ``sys.path`` there). Nothing in the installed package is edited: each
workaround replaces one attribute at run time, before or right after the peer is imported.

None of them changes the peer's arithmetic; the attention kernel is chosen in the config
(SDPA instead of Flex, which needs a GPU), not here:

* device: the peer picks ``cuda`` when torch sees no accelerator; here it picks ``cpu``;
* device memory statistics: ``torch.cpu`` has none, so the peer's monitor reports zeros;
* gradient reduction: the peer asks FSDP for a divide factor of 1.0, which FSDP turns into a
  premultiplied sum that gloo lacks; a factor of 1 is a plain sum, asked for as such;
* barrier: gloo takes no ``device_ids``;
* ``dist.set_timeout`` (newer torch) maps to the private per-group timeout setter of 2.13.
"""

from __future__ import annotations

import datetime
import functools
from typing import Any


def force_cpu_device() -> None:
    """Before the peer is imported: its ``tools.utils`` reads the device type at import time."""
    import torch._utils

    torch._utils._get_available_device_type = lambda: "cpu"


def _gloo_barrier(barrier: Any) -> Any:
    @functools.wraps(barrier)
    def wrapped(*args: Any, device_ids: Any = None, **kwargs: Any) -> Any:
        return barrier(*args, **kwargs)  # gloo refuses device_ids; CPU has one device anyway

    return wrapped


def _set_timeout(timeout: datetime.timedelta, group: Any = None) -> None:
    from torch.distributed import distributed_c10d as c10d

    c10d._set_pg_timeout(timeout, group)


def patch_distributed() -> None:
    """``barrier`` without device ids, ``set_timeout`` where torch 2.13 has only the private one."""
    import torch.distributed as dist

    dist.barrier = _gloo_barrier(dist.barrier)
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = _set_timeout


def patch_fsdp_plain_sum() -> None:
    """A gradient divide factor of 1.0 also asks FSDP for sum-only reductions: with that flag FSDP
    reduces with a plain SUM and divides afterwards by the factor, i.e. not at all; without it,
    FSDP asks the backend for a premultiplied sum, which gloo lacks."""
    from torch.distributed.fsdp import FSDPModule

    original = FSDPModule.set_gradient_divide_factor

    def set_gradient_divide_factor(self: FSDPModule, factor: float) -> None:
        original(self, factor)
        if factor == 1.0:
            self.set_force_sum_reduction_for_comms(True)

    FSDPModule.set_gradient_divide_factor = set_gradient_divide_factor


def patch_memory_monitor() -> None:
    """After the peer is imported: its device memory monitor reads CUDA-style statistics."""
    from torchtitan.components import metrics

    class _NoDeviceMemory:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.device_name, self.device_capacity, self.device_capacity_gib = "cpu", 0, 0.0

        def get_peak_stats(self) -> Any:
            return metrics.DeviceMemStats(0.0, 0.0, 0.0, 0.0, 0, 0)

        def reset_peak_stats(self) -> None:
            pass

    metrics.DeviceMemoryMonitor = _NoDeviceMemory
    metrics.build_device_memory_monitor = lambda: _NoDeviceMemory()


def stub_triton_kernels() -> None:
    """The peer imports its expert-parallel Triton kernels at import time even for dense models;
    torch's CPU build has no Triton, and a dense Llama never calls them."""
    import sys
    import types

    name = "torchtitan.distributed.minimal_async_ep.kernels"
    stub = types.ModuleType(name)

    def _unavailable(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("expert-parallel Triton kernels are not available on CPU")

    def _kernel(attr: str) -> Any:
        if attr.startswith("__"):  # module machinery (__file__, __path__) must stay absent
            raise AttributeError(attr)
        return _unavailable

    stub.__getattr__ = _kernel  # type: ignore[method-assign]
    sys.modules[name] = stub


def apply_before_import() -> None:
    force_cpu_device()
    stub_triton_kernels()
    patch_distributed()
    patch_fsdp_plain_sum()


def apply_after_import() -> None:
    patch_memory_monitor()
