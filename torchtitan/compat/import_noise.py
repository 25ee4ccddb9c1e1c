"""Warnings that importing torchao logs and that do not apply to the run, dropped where they are logged.

Each filter sits on the one logger that emits its warning and drops only that warning's message, so
every other record of those loggers still shows. ``quiet_import_noise()`` runs when ``torchtitan.compat``
is imported: every entry point imports it before torchao, which only Float8 and the MoE FP8 kernels
import, lazily. Dropped:

- torchao's "Failed to load <torchao>/_C*.so" for a library that links CUDA's runtime or torch's
  CUDA library, on a torch built without CUDA: its CUDA kernels, which such a build can neither load
  nor run. Any other library's failure stays, and so does every one with CUDA (kernels are missing).
- torchao's "Detected no triton", on a torch built without CUDA: its Triton kernels are GPU kernels,
  and no CPU build ships Triton. With CUDA the line stays.
- torch's deprecation of ``register_constant()`` on an Enum subclass, for torchao's enums (torchao
  registers ``KernelPreference`` so at import): addressed to torchao, which still works; nothing the
  run can change.
"""

from __future__ import annotations

import enum
import logging
import os
from collections.abc import Callable

import torch

TORCHAO_LOGGER = "torchao"  # torchao/__init__.py: its libraries' loading
TORCHAO_TRITON_LOGGER = "torchao.kernel.intmm"
PYTREE_LOGGER = "torch.utils._pytree"
_PYTREE_ENUM_DEPRECATION = "%s is an Enum subclass and is now natively supported"
_CUDA_LIBRARIES = (b"libcudart.so", b"libtorch_cuda.so")
_LINKED_NAMES_WITHIN = 1 << 20


class _Drop(logging.Filter):
    """Drops the records ``matches`` picks; passes every other one."""

    def __init__(self, matches: Callable[[logging.LogRecord], bool]) -> None:
        super().__init__()
        self.matches = matches

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.matches(record)


def _cuda_library_load_failure(record: logging.LogRecord) -> bool:
    """torchao's warning that one of its own ``_C*.so`` (in its package folder) did not load, for a CUDA library."""
    message = record.getMessage()
    own_libraries = os.path.join(os.path.dirname(record.pathname), "_C")
    if not message.startswith(f"Failed to load {own_libraries}"):
        return False
    return _links_cuda(message.removeprefix("Failed to load ").split(": ", 1)[0])


def _links_cuda(library: str) -> bool:
    """Whether a shared library names CUDA's runtime or torch's CUDA library among the ones it needs.

    The names it needs are in its dynamic string table, at the front of the file (some 12 KB in for
    torchao's); one not found in the first MiB counts as not linking CUDA, so its warning shows.
    """
    try:
        with open(library, "rb") as f:
            head = f.read(_LINKED_NAMES_WITHIN)
    except OSError:
        return False
    return any(name in head for name in _CUDA_LIBRARIES)


def _no_triton(record: logging.LogRecord) -> bool:
    return "Detected no triton" in record.getMessage()


def _torchao_enum_constant(record: logging.LogRecord) -> bool:
    """torch's deprecation warning for ``register_constant()`` on an Enum subclass that torchao defines."""
    if not (isinstance(record.msg, str) and record.msg.startswith(_PYTREE_ENUM_DEPRECATION)):
        return False
    cls = record.args[0] if isinstance(record.args, tuple) and record.args else None
    return isinstance(cls, type) and issubclass(cls, enum.Enum) and cls.__module__.startswith("torchao.")


def import_noise_filters() -> dict[str, Callable[[logging.LogRecord], bool]]:
    """Logger name -> the records dropped from it, on this torch build."""
    drops: dict[str, Callable[[logging.LogRecord], bool]] = {PYTREE_LOGGER: _torchao_enum_constant}
    if not torch.backends.cuda.is_built():
        drops[TORCHAO_LOGGER] = _cuda_library_load_failure
        drops[TORCHAO_TRITON_LOGGER] = _no_triton
    return drops


def quiet_import_noise() -> None:
    """Put the filters on their loggers, once (a second call adds nothing)."""
    for name, matches in import_noise_filters().items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) and f.matches is matches for f in logger.filters):
            logger.addFilter(_Drop(matches))
