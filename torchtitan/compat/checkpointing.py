"""Selective activation checkpointing's dispatch modes (``torch.utils.checkpoint``'s private caching modes).

SAC matches the recompute's ops to the forward's by their count per op. Profiler markers
(``record_function`` ranges) compute nothing, but hooks may open a different number of them in the
recompute than in the forward (FSDP2's hooks on a unit inside a checkpointed block, already unsharded
under a pipeline), which makes SAC look for an entry that was never stored. The modes here run the
markers outside that bookkeeping.
"""

from __future__ import annotations

from collections.abc import Callable

from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from torchtitan.compat.errors import missing

try:  # present in torch 2.11 to 2.14, with constructors that differ between them (not called here)
    from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode
except ImportError:  # pragma: no cover - a torch that moved them
    _CachedTorchDispatchMode = _CachingTorchDispatchMode = None


def _is_profiler_marker(op: object) -> bool:
    return getattr(op, "namespace", None) == "profiler"


if _CachingTorchDispatchMode is not None and _CachedTorchDispatchMode is not None:

    class _KeepingMode(_CachingTorchDispatchMode):
        """SAC's forward mode, with profiler markers run outside its op counts."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            if _is_profiler_marker(func):
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

    class _ReusingMode(_CachedTorchDispatchMode):
        """SAC's recompute mode, with profiler markers run outside its op counts."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            if _is_profiler_marker(func):
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)


def selective_contexts_without_profiler_markers(policy: Callable[..., CheckpointPolicy]) -> tuple[object, object]:
    """``create_selective_checkpoint_contexts(policy)`` with profiler markers left out of its op counts.

    torch builds the two modes (their constructors differ between releases: 2.11's recompute mode takes
    ``allow_cache_entry_mutation`` without a default); only their class is changed, to the subclasses above,
    which add no state.
    """
    keeping, reusing = create_selective_checkpoint_contexts(policy)
    if _CachingTorchDispatchMode is None or not isinstance(keeping, _CachingTorchDispatchMode) \
            or _CachedTorchDispatchMode is None or not isinstance(reusing, _CachedTorchDispatchMode):
        raise missing("torch.utils.checkpoint._CachingTorchDispatchMode / _CachedTorchDispatchMode")
    keeping.__class__ = _KeepingMode
    reusing.__class__ = _ReusingMode
    return keeping, reusing
