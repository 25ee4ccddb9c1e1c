"""GPT-OSS's attention (a learned sink logit per head, a sliding window on alternate layers), priced as the GPU runs it.

On CUDA ``local_sink_attention`` (``models/attention/kernels.py``) runs FlexAttention under the layer's block
mask: one kernel that keeps only the output and a log-sum-exp per row and skips the blocks that the causal mask
and the window leave empty; the sinks then rescale the output through the log-sum-exp (``rescale_by_sinks``).
The dry run's tensors are not on CUDA, so the call takes the CPU's kernel instead: float32 scores [B, H, L, L]
with a sink column under a dense mask, a softmax and a cat, memory-bound kernels over score-sized tensors kept
for the backward, at every layer whatever its window. Priced as that, GPT-OSS's step was its attention.

Inside ``sink_attention_as_on_gpu()`` (the dry run) whole sequences (no documents, no context parallelism) run
the CUDA path's shape: a planner-only op standing for FlexAttention with its log-sum-exp, whose window is an
argument ``compute.attention_flops`` reads (about L x W products, not L² / 2), then the same
``rescale_by_sinks`` as on CUDA, so the sinks get their gradient from the same kernels a GPU runs. Calls with
documents keep the dense path: the dry run passes no positions (``dry_run.py``), so it makes none.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from torchtitan.distributed.activation_checkpoint import keep_as_attention
from torchtitan.models.attention import backends
from torchtitan.models.attention.kernels import rescale_by_sinks
from torchtitan.models.attention.masks import DocumentMask

_NAMESPACE = "torchtitan_planning"
_SHAPES_ONLY = "the planner's FlexAttention has shapes only: it runs on fake tensors (planning/dry_run.py)"
_Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _check_window(window: int, is_causal: bool) -> None:
    if window < 0 or (window and not is_causal):
        raise ValueError(f"the planner's FlexAttention takes a causal sliding window of >= 1 keys or 0 (none), "
                         f"not window={window} with is_causal={is_causal}")


@torch.library.custom_op(f"{_NAMESPACE}::flex_attention", mutates_args=())
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
             is_causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    raise RuntimeError(_SHAPES_ONLY)


@_forward.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
      is_causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    _check_window(window, is_causal)
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    logsumexp = q.new_empty(q.shape[:-1], dtype=torch.float32)  # FlexAttention's return_lse=True
    return out, logsumexp


@torch.library.custom_op(f"{_NAMESPACE}::flex_attention_backward", mutates_args=())
def _backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              logsumexp: torch.Tensor, grad_logsumexp: torch.Tensor | None, window: int, is_causal: bool) -> _Grads:
    raise RuntimeError(_SHAPES_ONLY)


@_backward.register_fake
def _(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
      logsumexp: torch.Tensor, grad_logsumexp: torch.Tensor | None, window: int, is_causal: bool) -> _Grads:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:  # noqa: ANN001 - torch.library's signature
    q, k, v, window, is_causal = inputs
    out, logsumexp = output
    ctx.save_for_backward(q, k, v, out, logsumexp)
    ctx.window, ctx.is_causal = window, is_causal


def _grads(ctx, grad_out: torch.Tensor, grad_logsumexp: torch.Tensor | None):  # noqa: ANN001, ANN202
    q, k, v, out, logsumexp = ctx.saved_tensors
    dq, dk, dv = _backward(grad_out.contiguous(), q, k, v, out, logsumexp, grad_logsumexp, ctx.window,
                           ctx.is_causal)
    return dq, dk, dv, None, None


_forward.register_autograd(_grads, setup_context=_setup_context)
# Selective AC keeps a fused attention kernel's output (distributed/activation_checkpoint.py): so this one's.
keep_as_attention(torch.ops.torchtitan_planning.flex_attention.default)


def flex_sink_attention_as_on_gpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
                                  window: int | None) -> torch.Tensor:
    """``kernels.flex_sink_attention`` of whole causal sequences with the planner's op for FlexAttention:
    q [B, H, L, D]; k, v [B, H_kv, L, D(_v)] read in place (grouped heads); sinks [H] or None."""
    out, logsumexp = _forward(q, k, v, window or 0, True)
    return rescale_by_sinks(out, logsumexp, sinks)


@contextlib.contextmanager
def sink_attention_as_on_gpu() -> Iterator[None]:
    """Inside, the attention backends' whole-sequence sink attention runs as on CUDA (module docstring).

    The backends' attribute is replaced, not wrapped in a function mode: activation checkpointing recomputes
    the forward in the backward, where a mode entered around the step is not in force, and the recomputed
    tensors must match the saved ones. The dry run runs each simulation in a process of its own.
    """
    plain = backends.local_sink_attention

    def local_sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: DocumentMask | None,
                             sinks: torch.Tensor | None, window: int | None) -> torch.Tensor:
        if documents is not None or q.is_cuda:
            return plain(q, k, v, documents, sinks, window)
        return flex_sink_attention_as_on_gpu(q, k, v, sinks, window)

    backends.local_sink_attention = local_sink_attention
    try:
        yield
    finally:
        backends.local_sink_attention = plain
