"""The dispatch mode that watches a dry-run step, and the GPU code paths the step runs under.

``StepRecorder`` sees every op of the step (below it, ``FakeTensorMode`` computes shapes only) and
hands it to the three ledgers: memory (each new storage, tagged by what the step is doing), traffic
(each collective) and compute (each kernel's work); ``follow``, one of the step's callbacks, tells it
which part of the step runs. DTensor ops arrive at their global shapes; the
ledgers read their local tensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

from torchtitan.compat import (
    TorchDispatchMode,
    c10d_op,
    fsdp_storage_hooks,
    in_autograd_backward,
    storage_id,
    tree_flatten,
)
from torchtitan.planning.compute import ComputeLedger, PhaseWork
from torchtitan.planning.memory import MemoryLedger, local_tensor
from torchtitan.planning.traffic import TrafficLedger
from torchtitan.train_step.callbacks import StepEvent, StepPoint

c10d = torch.ops.c10d
_WAIT = torch.ops._c10d_functional.wait_tensor.default
_ASYNC_ALL_TO_ALL = torch.ops._c10d_functional.all_to_all_single.default
_GATHER_OUTPUT = {c10d_op("_allgather_base_"), c10d.allgather_into_tensor_coalesced_.default}
_SCATTER_OUTPUT = {c10d_op("_reduce_scatter_base_"), c10d.reduce_scatter_tensor_coalesced_.default}


class StepRecorder(TorchDispatchMode):
    """Feeds every op of the step to the memory, traffic and compute ledgers."""

    def __init__(self, memory: MemoryLedger, traffic: TrafficLedger, compute: ComputeLedger):
        super().__init__()
        self.memory, self.traffic, self.compute = memory, traffic, compute
        self._phase = "build"
        self._in_logits = 0
        self.microbatch = ""  # set by the pipeline's stage hooks: "stage.microbatch"
        # In-flight all-to-alls: their output's storage id -> their row and bytes (the compute ledger keeps the work)
        self._in_flight: dict[int, tuple[tuple[str, str, str, str], int]] = {}

    # ---- what the step is doing ----------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        before = self._phase
        self._set_phase(name)
        try:
            yield
        finally:
            self._set_phase(before)

    def _set_phase(self, name: str) -> None:
        self._phase = self.memory.phase = self.traffic.phase = self.compute.phase = name

    def _tag(self) -> str:
        if in_autograd_backward():
            return "backward"
        if self._in_logits:
            return "logits_and_loss"
        if self._phase == "forward":
            return f"activations@{self.microbatch}"
        return "optimizer" if self._phase == "optimizer" else "buffers"

    def follow(self, event: StepEvent) -> None:
        """A step callback (``train_step/callbacks.py``): what the trainer's step is doing, from its points.

        A micro-batch's forward, its loss (the logits' scope), its backward, and the tail from clipping
        on (``optimizer``); between them the phase is ``build``. Through the pipeline a micro-batch is one
        schedule step, all of it ``forward`` (the ops tell its backwards apart).
        """
        point = event.point
        if point is StepPoint.MICRO_BATCH_START:
            self._set_phase("forward")
        elif point is StepPoint.FORWARD_END:
            self._in_logits += 1
        elif point is StepPoint.BACKWARD_START:
            self._in_logits -= 1
            self._set_phase("backward")
        elif point is StepPoint.MICRO_BATCH_END:
            self._set_phase("build")
            self.mark_gradients(event.strategy.parts.runner.parameters())
        elif point is StepPoint.GRADIENTS_READY:
            self._set_phase("optimizer")
        elif point is StepPoint.STEP_END:
            self._set_phase("build")

    def mark_gradients(self, params: Iterable[torch.Tensor]) -> None:
        """After a micro-batch's backward: every gradient's storage counts as a gradient."""
        for p in params:
            if p.grad is not None:
                self.memory.register(p.grad, "gradients")

    def watch_blocks(self, blocks: list[torch.nn.Module]) -> None:
        """Start a memory region (``MemoryLedger.enter``) where each block's forward begins (before FSDP's
        gather) and where its backward begins (its output's gradient is ready), named by the block's place:
        first, middle or last (``symmetry.py`` counts the middle ones)."""
        for i, block in enumerate(blocks):
            place = "first" if i == 0 else "last" if i == len(blocks) - 1 else "middle"
            block.register_forward_pre_hook(lambda *_, place=place: self.memory.enter(f"forward {place}"),
                                            prepend=True)
            block.register_forward_hook(lambda _m, _a, out, place=place: self._mark_backward(out, place))

    def _mark_backward(self, out, place: str) -> None:
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda _grad: self.memory.enter(f"backward {place}"))

    # ---- the ops ----------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        in_backward = in_autograd_backward()
        self.memory.tag = self._tag()
        out = func(*args, **kwargs)
        phase_before = self.traffic.phase
        if in_backward and self._phase == "forward":  # the pipeline schedule runs backward inside its step
            self.traffic.phase = self.compute.phase = "backward"
        if func is _WAIT:
            self._close_cover(args[0])
        if self.traffic.on_op(func, args, out):
            if func in _GATHER_OUTPUT:
                self.memory.register(args[0], "gathered_parameters")
            elif func in _SCATTER_OUTPUT and in_backward:
                self.memory.register(args[0], "gradients")
        self.compute.on_op(func, args, kwargs, out)
        if func is _ASYNC_ALL_TO_ALL and self.traffic.recording:
            self._open_cover(out)
        self.traffic.phase = self.compute.phase = phase_before
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.memory.register(t)
        return out


    # ---- what hides an all-to-all ------------------------------------------------
    # A functional all-to-all's issue opens a window that the wait on its output closes; the work the compute
    # ledger records in between is its cover. A blocking exchange waits at once: an empty cover, not kept.
    def _open_cover(self, out: torch.Tensor) -> None:
        assert self.traffic.last is not None, "the traffic ledger recorded the all-to-all"
        key = storage_id(local_tensor(out).untyped_storage())
        self._in_flight[key] = self.traffic.last
        self.compute.covers[key] = PhaseWork()

    def _close_cover(self, waited: torch.Tensor) -> None:
        key = storage_id(local_tensor(waited).untyped_storage())
        issued, work = self._in_flight.pop(key, None), self.compute.covers.pop(key, None)
        if issued is not None and work is not None and work.kernels:
            self.traffic.covered(*issued, work.as_tuple())


def track_fsdp_storage(memory: MemoryLedger) -> contextlib.AbstractContextManager[None]:
    """Follow FSDP2's unsharded parameters, whose storages it resizes in place (no op the mode sees),
    and tag the unsharded gradients it accumulates as gradients."""
    return fsdp_storage_hooks(on_resize=lambda t: memory.note_resize(t, "gathered_parameters"),
                              on_accumulated_grad=lambda g: memory.register(g, "gradients"))
