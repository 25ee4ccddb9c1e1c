"""Attention whose value head differs from its query head (MLA: 192 against 128), priced as the GPU runs it.

On CUDA the trainer's ``F.scaled_dot_product_attention`` runs such a call in one fused kernel (the
memory-efficient or cuDNN backend; FlexAttention under ``block_causal``), which keeps only the output and
a log-sum-exp per row. The CPU has no fused kernel for it: the dry run's call would fall back to the math
decomposition, which materializes the float32 score matrix (128 heads x 4,096^2 x 4 bytes, 8 GiB per
DeepSeek-V3 layer and micro-batch) in half a dozen memory-bound kernels and keeps it for the backward.
Priced as that, MLA's attention was two thirds of DeepSeek-V3 671B's planned compute, and its kept
scores made every selective recompute policy too large to fit.

Inside ``fused_attention_as_on_gpu()`` (the dry run) such calls go through two planner-only ops named
like torch's fused ones, so ``compute.py`` prices them as attention (FLOPs of both products, at the
cluster's attention efficiency) and ``memory.py`` sees what the fused kernel keeps. Calls with equal
heads are left alone: the CPU's own fused kernel already runs them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from torchtitan.distributed.activation_checkpoint import keep_as_attention

_NAMESPACE = "torchtitan_planning"
_Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@torch.library.custom_op(f"{_NAMESPACE}::scaled_dot_product_attention", mutates_args=())
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
             scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    raise RuntimeError("the planner's fused attention has shapes only: it runs on fake tensors (planning/dry_run.py)")


@_forward.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    logsumexp = q.new_empty(q.shape[:-1], dtype=torch.float32)  # what the fused kernels keep besides the output
    return out, logsumexp


@torch.library.custom_op(f"{_NAMESPACE}::scaled_dot_product_attention_backward", mutates_args=())
def _backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              logsumexp: torch.Tensor, is_causal: bool, scale: float) -> _Grads:
    raise RuntimeError("the planner's fused attention has shapes only: it runs on fake tensors (planning/dry_run.py)")


@_backward.register_fake
def _(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
      logsumexp: torch.Tensor, is_causal: bool, scale: float) -> _Grads:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:  # noqa: ANN001 - torch.library's signature
    q, k, v, is_causal, scale = inputs
    out, logsumexp = output
    ctx.save_for_backward(q, k, v, out, logsumexp)
    ctx.is_causal, ctx.scale = is_causal, scale


def _grads(ctx, grad_out: torch.Tensor, _grad_logsumexp: torch.Tensor):  # noqa: ANN001, ANN202
    q, k, v, out, logsumexp = ctx.saved_tensors
    dq, dk, dv = _backward(grad_out.contiguous(), q, k, v, out, logsumexp, ctx.is_causal, ctx.scale)
    return dq, dk, dv, None, None


_forward.register_autograd(_grads, setup_context=_setup_context)
# Selective AC keeps a fused attention kernel's output (distributed/activation_checkpoint.py): so this one's.
keep_as_attention(torch.ops.torchtitan_planning.scaled_dot_product_attention.default)


def _fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
           dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
           enable_gqa: bool = False) -> torch.Tensor | None:
    """The planner's op for a call the CPU would decompose; None for one it runs fused (or with a mask)."""
    if v.shape[-1] == q.shape[-1] or attn_mask is not None or dropout_p:
        return None
    # Grouped K/V heads (enable_gqa) go in as they are: the fused kernels read them in place, and the work
    # (compute.attention_flops) is counted over the query heads.
    out, _ = _forward(q, k, v, is_causal, 1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    return out


@contextlib.contextmanager
def fused_attention_as_on_gpu() -> Iterator[None]:
    """Inside, attention with a value head of its own size runs as the planner's fused op (module docstring).

    ``torch.nn.functional``'s attribute is replaced, not wrapped in a function mode: activation checkpointing
    recomputes the forward in the backward, where a mode entered around the step is not in force, and the
    recomputed tensors must match the saved ones. The dry run runs each simulation in a process of its own.
    """
    plain = F.scaled_dot_product_attention

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                  dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                  enable_gqa: bool = False) -> torch.Tensor:
        fused = _fused(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if fused is not None:
            return fused
        return plain(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                     enable_gqa=enable_gqa)

    F.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = plain
