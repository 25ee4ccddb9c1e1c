"""Pipeline-schedule internals: skipping the shape exchange (the planner's fake world), a warm-up without
messages to a stage's own rank (torch 2.11), whether the split backward takes a custom autograd function (not
on torch 2.11), and telling a stage's shape-inference forward from a real one."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from torchtitan.compat.errors import missing

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage


def skip_pipeline_shape_exchange(schedule: Any) -> None:
    """Make ``schedule``'s first step take every stage as static, with no exchange of shapes over the pp group.

    From torch 2.13 the schedule's warm-up (``_warmup_p2p``) sends each stage's shapes and votes on whether
    every stage stated them; a stage in ``InferenceMode.STATIC`` (its ``_inference_mode``) uses the shapes it
    was given. A fake process group delivers no numbers, so the dry run skips the warm-up. torch 2.11 has
    neither: a stage that was given its shapes (``inputs_meta``) skips its shape inference by itself, and the
    warm-up is one empty message to and from each neighbour stage (``_get_init_p2p_neighbors_ops``), dropped.
    """
    if hasattr(schedule, "_warmup_p2p"):
        _skip_warmup_vote(schedule)
        return
    stages: list[Any] = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]
    for stage in stages:
        if not hasattr(stage, "_get_init_p2p_neighbors_ops") or not hasattr(stage, "inputs_meta"):
            raise missing(f"{type(schedule).__name__}._warmup_p2p (or a stage's _get_init_p2p_neighbors_ops)")
        if stage.inputs_meta is None:
            raise ValueError(f"pipeline stage {stage.stage_index} states no input shapes (PipelineStage's "
                             "input_args): it would learn them from its neighbour, which a fake world cannot")
        stage._get_init_p2p_neighbors_ops = list
        if not hasattr(stage, "_validate_fwd_input"):
            raise missing("PipelineStage._validate_fwd_input")
        if stage.is_first:  # torch checks only the first stage's inputs
            stage._validate_fwd_input = functools.partial(_same_shapes, stage)


def _same_shapes(stage: Any, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
    """torch 2.11's check of a first stage's micro-batches against its stated inputs, strides left out: the
    dry run states the token ids contiguous, while a batch's are a view of one token more per sequence. As
    torch's, it checks nothing when keywords come too (it cannot tell which stated input each one is)."""
    if kwargs:
        return
    given = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
    stated = [tuple(m.shape) for m in stage.inputs_meta if isinstance(m, torch.Tensor)]
    if given != stated:
        raise ValueError(f"pipeline stage {stage.stage_index}: micro-batch inputs of shapes {given}, "
                         f"stated {stated} (PipelineStage's input_args)")


def stage_gradient_keywords(input_grads: Any, output_grads: Any) -> dict[str, Any]:
    """``PipelineStage``'s keywords that state a stage's gradients, where the installed torch takes them.

    From torch 2.13 a stage that is not given its gradients (``input_grads``, ``output_grads``) learns them
    in a backward on its first step, over the pp group. torch 2.11 has neither keyword nor that backward: it
    sizes the gradients as the stated activations, so the keywords are left out.
    """
    from torch.distributed.pipelining import PipelineStage

    taken = inspect.signature(PipelineStage.__init__).parameters
    if "input_grads" in taken and "output_grads" in taken:
        return {"input_grads": input_grads, "output_grads": output_grads}
    return {}


def _skip_warmup_vote(schedule: Any) -> None:
    """torch 2.13 and later: every stage ``InferenceMode.STATIC``, no ``_warmup_p2p`` messages or vote."""
    try:
        from torch.distributed.pipelining._utils import InferenceMode
    except ImportError as e:
        raise missing("torch.distributed.pipelining._utils.InferenceMode") from e
    if not hasattr(InferenceMode, "STATIC"):
        raise missing("InferenceMode.STATIC")

    def all_static(stages: list[Any], has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    schedule._warmup_p2p = all_static


def warm_up_other_ranks_only(stage: PipelineStage) -> None:
    """Leave out of ``stage``'s (a ``PipelineStage``'s) first-step warm-up the messages to and from its own rank.

    A multi-stage schedule of torch 2.11 warms up the pp group with one send and one receive to each neighbour
    stage (``_get_init_p2p_neighbors_ops``), also where the neighbour is on the same rank, as stages 1 and 2 are
    on pp rank 1 of a V-shaped schedule (ZBVZeroBubble, DualPipeV). gloo has no connection from a rank to
    itself, so the first step failed there: "Pair is not connected ... <--> [none]". Such a message carries
    nothing (the schedule hands same-rank activations over in memory), so it is dropped, on every backend. From
    torch 2.13 PipelineStage's warm-up (``_warmup_p2p``) skips same-rank neighbours itself and no longer calls
    the method; a release without the method has nothing to drop. Wraps this instance's method only.
    """
    neighbour_ops = getattr(stage, "_get_init_p2p_neighbors_ops", None)
    if neighbour_ops is None:
        return

    def other_ranks_only() -> list[torch.distributed.P2POp]:
        ops = neighbour_ops()
        if any(not hasattr(op, "group_peer") for op in ops):
            raise missing("torch.distributed.P2POp.group_peer")
        return [op for op in ops if op.group_peer != stage.group_rank]

    stage._get_init_p2p_neighbors_ops = other_ranks_only


class _TimesWeight(torch.autograd.Function):
    """x W^T as one custom autograd node of the activation and the weight, as a custom linear kernel makes it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
        x, weight = ctx.saved_tensors
        return grad @ weight, grad.t() @ x


@functools.cache
def split_backward_takes_custom_functions() -> bool:
    """Whether the zero-bubble schedules' weight pass can start from a custom autograd function's node.

    Those schedules split a stage's backward: the input pass keeps the nodes where the weights' part of the
    graph meets the activations' (for a custom linear kernel: its own node), the weight pass later starts
    from them (``stage_backward_input``, ``stage_backward_weight``). On torch 2.11 a custom function's node
    no longer answers by then ("Attribute '_input_metadata' is invalid for this instance of
    _C._FunctionBase"); 2.13 takes it. Tried once on a 2 x 2 product.
    """
    try:
        from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
    except ImportError as e:
        raise missing("torch.distributed.pipelining._backward.stage_backward_input / stage_backward_weight") from e
    weight = torch.nn.Parameter(torch.ones(2, 2))
    x = torch.ones(2, 2, requires_grad=True)
    _, groups = stage_backward_input([_TimesWeight.apply(x, weight)], [torch.ones(2, 2)], [x], iter([weight]))
    try:
        stage_backward_weight(iter([weight]), groups)
    except RuntimeError as e:
        if "_input_metadata" not in str(e):
            raise
        return False
    return True


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
        raise missing("PipelineStage._forward_metadata_inference (or _shape_inference)")
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


def step_keeping_no_outputs(step: Callable[..., object]) -> dict[str, bool]:
    """Keyword arguments for a schedule's ``step`` that stop the last stage from keeping every micro-batch's output.

    By default a schedule's last stage keeps each micro-batch's output (the logits) until the step ends,
    to return them merged: on a large vocabulary that is a whole step's logits at once (DeepSeek-V3 671B's
    last stage: 23 of its 24 micro-batches of 4096 x 129280 bf16 logits, 23 GiB). The trainer reads only the losses.
    A release without the flag (``return_outputs``) keeps them.
    """
    return {"return_outputs": False} if "return_outputs" in inspect.signature(step).parameters else {}
