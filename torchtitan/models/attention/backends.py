"""Attention backends: the objects that turn queries, keys and values into attention outputs.

An attention *module* (``gqa.py``: grouped-query attention, with or without QK-norm; next MLA and
attention with sinks) owns the projections and says what it needs; it hands the score computation to a
*backend*:

    xq, xk = backend.rotate(xq, xk, rope)            # the rotary kernel (all of a head, or its rope part)
    out = backend.attend(q, k, v, documents, extras)  # q [B, H, L, D_qk]; k [B, H_kv, L, D_qk]; v [B, H_kv, L, D_v]

The decoder holds one backend and passes it to every block in its forward, with the forward's document
mask (``backend.document_mask``, built once and shared by the layers); the blocks hold no kernel
state, so nothing in the model is patched, re-classed or set per layer. The backend is chosen in one
place, ``select_backend``, from ``--model.attention_backend``, the mask, the device and context
parallelism; ``backend_problems`` compares a backend's stated ``Capabilities`` with what the model
needs (``AttentionNeeds``), one line per gap, and the decoder's preflight check refuses those.

The backends (``BACKENDS``):

==================  ==================  ========  ==========  ========
name                masks               devices   CP          KV cache
==================  ==================  ========  ==========  ========
``sdpa``            causal              any       no          no
``document_sdpa``   causal, documents   any       no          no
``flex``            causal, documents   cuda      no          no
``context_parallel``causal, documents   any       yes         no
``kv_cache``        the cache's own     any       no          yes
==================  ==================  ========  ==========  ========

- ``sdpa``: causal SDPA over whole windows; on an eager CPU with the CPU kernels on, SDPA reads each
  K/V head for its query group itself (``enable_gqa``) instead of repeated copies (ops/cpu_kernels.py).
- ``document_sdpa``: the block-causal mask on CPU, one causal SDPA per document (the dense boolean mask
  under ``torch.compile``); causal as ``sdpa`` when a forward has no positions.
- ``flex``: FlexAttention with a block mask (CUDA); causal as ``sdpa``.
- ``context_parallel``: both masks over this rank's two load-balanced chunks against the whole
  sequence's keys (all-gathered over the ``cp`` mesh); document masks from the whole sequence's positions.
- ``kv_cache``: decoding (``models/kv_cache.py``): the new tokens' queries against every cached key,
  under the cache's padding and causal mask (``attend_cached``; the attention module appends this step's
  keys and values to its layer's cache first, in its own form: MLA keeps the latent). The decoder's cached
  forward hands every block ``decoding_backend``'s choice: the run's backend when it decodes, else this one.

Every backend here applies what the shipped attentions pass beyond q, k and v, so no capability states
it: a learned per-head sink logit (``ScoreExtras.sinks``) and a sliding window (``ScoreExtras.window``,
composed with the document mask), which GPT-OSS's attention passes, run the sink kernels of ``kernels.py``
(FlexAttention rescaled by the sink on CUDA, explicit scores with the sink column elsewhere, per chunk under
context parallelism, a window over the cache's slots in decoding); and MLA's value head size (``D_v``),
other than the query/key size, which SDPA, FlexAttention and the KV cache all take.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.distributed.context_parallel import cp_attention
from torchtitan.models.attention.kernels import block_causal_attention as _device_block_causal
from torchtitan.models.attention.kernels import (
    cached_sink_attention,
    cp_block_causal_attention,
    cp_sink_attention,
    local_sink_attention,
    per_document_sdpa,
)
from torchtitan.models.attention.masks import DocumentMask, build_document_mask, cp_document_mask
from torchtitan.models.layers import apply_rotary_emb, repeat_kv
from torchtitan.ops.cpu_kernels import eager_cpu, rotate_pairs_complex

BACKEND_CHOICES = ("auto", "sdpa", "document_sdpa", "flex")  # --model.attention_backend


@dataclass(frozen=True)
class Capabilities:
    """What a backend applies; ``backend_problems`` refuses a model that needs more."""

    masks: frozenset[str]  # of attention.masks.MASK_TYPES
    devices: frozenset[str] = frozenset({"cpu", "cuda"})
    context_parallel: bool = False
    kv_cache: bool = False  # attend_cached: decoding against a layer's cache


@dataclass(frozen=True)
class AttentionNeeds:
    """What a model's attention asks of its backend (the attention module's config states it): a mask of
    ``attention.masks.MASK_TYPES``. Sinks, windows and a value head of its own size every backend applies."""

    mask: str


@dataclass(frozen=True)
class ScoreExtras:
    """Per-call score modifiers beyond q, k and v (every backend applies both)."""

    sinks: torch.Tensor | None = None  # [H] learned logits (one per query head)
    window: int | None = None  # keys at most this many positions back

    @property
    def any(self) -> bool:
        return self.sinks is not None or self.window is not None


NO_EXTRAS = ScoreExtras()


def _gqa_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cpu_kernels: bool) -> torch.Tensor:
    """Causal SDPA over whole windows; K/V heads repeated per query group, or read in place by the eager CPU kernel."""
    if cpu_kernels and q.shape[1] != k.shape[1] and eager_cpu(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    n_rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), is_causal=True)


class AttentionBackend(ABC):
    """Rotary and score kernels for every attention layer of a model (see the module docstring).

    ``cpu_kernels``: the eager-CPU kernels of ops/cpu_kernels.py (complex-product RoPE, in-place GQA),
    bitwise the plain math's outputs; each runs only where ``eager_cpu`` holds.
    """

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]

    def __init__(self, cpu_kernels: bool = False) -> None:
        self.cpu_kernels = cpu_kernels

    def rotate(self, xq: torch.Tensor, xk: torch.Tensor, rope_cache: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate query and key heads [B, L, H, D_rope] by ``rope_cache`` [L, D_rope] or [B, L, D_rope]."""
        if not (self.cpu_kernels and eager_cpu(xq, xk)):
            return apply_rotary_emb(xq, xk, rope_cache)
        cos, sin = rope_cache.unsqueeze(-2).chunk(2, dim=-1)
        rotation = torch.complex(cos.float(), sin.float())  # a bf16 cache widens exactly, as the real path promotes it
        return rotate_pairs_complex(xq, rotation), rotate_pairs_complex(xk, rotation)

    def document_mask(self, positions: torch.Tensor, batch: int | None) -> DocumentMask:
        """The documents of one forward's rows (built once, shared by the layers)."""
        return build_document_mask(positions, batch)

    @abstractmethod
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: DocumentMask | None,
               extras: ScoreExtras = NO_EXTRAS) -> torch.Tensor:
        """Attention outputs [B, H, L, D_v]; ``documents`` None: causal over the whole window."""

    def attend_cached(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      extras: ScoreExtras = NO_EXTRAS) -> torch.Tensor:
        """Decoding: the new tokens' queries q [B, H, new, D_qk] against every key and value a layer's cache
        holds (k [B, H_kv, filled, D_qk], v [B, H_kv, filled, D_v], this step's appended), where ``mask``
        [B, 1, new, filled] allows (the cache's padding and causal mask) -> [B, H, new, D_v]."""
        raise ValueError(f"the {self.name} attention backend does not decode against a KV cache; hand the "
                         f"attention the {KVCacheDecode.name} backend (decoding_backend)")


class SDPACausal(AttentionBackend):
    """``sdpa``: causal scaled-dot-product attention over whole windows."""

    name = "sdpa"
    capabilities = Capabilities(masks=frozenset({"causal"}))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: DocumentMask | None,
               extras: ScoreExtras = NO_EXTRAS) -> torch.Tensor:
        if documents is not None:
            raise ValueError("the sdpa attention backend applies the causal mask only")
        if extras.any:
            return local_sink_attention(q, k, v, None, extras.sinks, extras.window)
        return _gqa_sdpa(q, k, v, self.cpu_kernels)


class DocumentSDPA(AttentionBackend):
    """``document_sdpa``: the block-causal mask as one causal SDPA per document (dense mask under compile)."""

    name = "document_sdpa"
    capabilities = Capabilities(masks=frozenset({"causal", "block_causal"}))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: DocumentMask | None,
               extras: ScoreExtras = NO_EXTRAS) -> torch.Tensor:
        if extras.any:
            return local_sink_attention(q, k, v, documents, extras.sinks, extras.window)
        if documents is None:
            return _gqa_sdpa(q, k, v, self.cpu_kernels)
        return self.block_causal(q, k, v, documents)

    def block_causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: DocumentMask
                     ) -> torch.Tensor:
        """The document-masked scores: one SDPA per document on CPU; CUDA's block masks, or the dense mask when
        compiling."""
        if q.is_cuda or torch.compiler.is_compiling():
            return _device_block_causal(q, k, v, documents)
        return per_document_sdpa(q, k, v, documents.segment_lengths())


class FlexDocument(DocumentSDPA):
    """``flex``: FlexAttention with a block mask built once per forward (CUDA); otherwise ``document_sdpa``'s."""

    name = "flex"
    capabilities = Capabilities(masks=frozenset({"causal", "block_causal"}), devices=frozenset({"cuda"}))

    def block_causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: DocumentMask
                     ) -> torch.Tensor:
        return _device_block_causal(q, k, v, documents)


class ContextParallel(AttentionBackend):
    """``context_parallel``: each ``cp`` rank holds two load-balanced chunks of every sequence
    (torchtitan/distributed/context_parallel.py) and attends to the whole sequence's keys, all-gathered
    over ``mesh``; the document mask comes from the whole sequence's positions."""

    name = "context_parallel"
    capabilities = Capabilities(masks=frozenset({"causal", "block_causal"}), context_parallel=True)

    def __init__(self, mesh: DeviceMesh, cpu_kernels: bool = False) -> None:
        super().__init__(cpu_kernels)
        self.mesh = mesh

    def document_mask(self, positions: torch.Tensor, batch: int | None) -> DocumentMask:
        return cp_document_mask(positions, batch, mesh=self.mesh)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: DocumentMask | None,
               extras: ScoreExtras = NO_EXTRAS) -> torch.Tensor:
        if extras.any:
            return cp_sink_attention(q, k, v, documents, extras.sinks, extras.window, self.mesh)
        if documents is None:
            return cp_attention(q, k, v, mesh=self.mesh)
        return cp_block_causal_attention(q, k, v, documents, mesh=self.mesh)


class KVCacheDecode(AttentionBackend):
    """``kv_cache``: decoding; the new tokens' queries against every key the layer's cache holds."""

    name = "kv_cache"
    capabilities = Capabilities(masks=frozenset({"causal"}), kv_cache=True)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: DocumentMask | None,
               extras: ScoreExtras = NO_EXTRAS) -> torch.Tensor:
        raise ValueError("the kv_cache attention backend decodes against a cache: call attend_cached")

    def attend_cached(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      extras: ScoreExtras = NO_EXTRAS) -> torch.Tensor:
        if extras.any:
            return cached_sink_attention(q, k, v, mask, extras.sinks, extras.window)
        n_rep = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), attn_mask=mask)


BACKENDS: dict[str, type[AttentionBackend]] = {
    b.name: b for b in (SDPACausal, DocumentSDPA, FlexDocument, ContextParallel, KVCacheDecode)}


_DENSE = "SDPA with the dense document mask"
_DOCS_MASK = "attention mask: block_causal (documents from the data's positions)"
_DOCS = _DOCS_MASK + "; kernel: "


def has_score_extras(model: torch.nn.Module) -> bool:
    """Whether ``model``'s attention has learned sinks (GPT-OSS's attention holds a ``sinks`` parameter, and its
    sliding windows come with them), so its scores go through the sink kernels."""
    return any(isinstance(getattr(m, "sinks", None), torch.nn.Parameter) for m in model.modules())


def describe_score_extras(device_type: str, context_parallel: bool) -> str:
    """The kernel of attention with sinks and sliding windows (GPT-OSS's): FlexAttention on CUDA, and why not."""
    what = "kernel for the sinks and sliding windows: "
    explicit = "the explicit scores with the sink column run"
    if context_parallel:
        return what + f"FlexAttention skipped under context parallelism ({explicit}, per chunk)"
    if device_type != "cuda":
        return what + f"FlexAttention skipped, no CUDA device ({explicit})"
    return what + "FlexAttention with a block mask, rescaled by the sinks"


def describe_backend(choice: str, mask_type: str, device_type: str, *, compiled: bool, context_parallel: bool,
                     score_extras: bool = False) -> str:
    """The log line naming the mask and the kernel a run uses; ``score_extras``: the model's attention has sinks
    or sliding windows (GPT-OSS), which every backend hands the sink kernels."""
    if score_extras:
        mask = _DOCS_MASK if mask_type != "causal" else "attention mask: causal (across documents)"
        return f"{mask}; {describe_score_extras(device_type, context_parallel)}"
    name = backend_name(choice, mask_type, device_type, context_parallel)
    cp = " (context parallel chunks)" if context_parallel else ""
    if mask_type == "causal":
        return f"attention mask: causal (across documents); kernel: causal SDPA{cp}"
    if device_type == "cuda" and name in (FlexDocument.name, ContextParallel.name):
        return _DOCS + "FlexAttention with a block mask" + cp
    if compiled or context_parallel:
        return _DOCS + _DENSE + cp
    return _DOCS + "one causal SDPA per document"


def backend_name(choice: str, mask_type: str, device_type: str, context_parallel: bool) -> str:
    """The backend ``select_backend`` gives for ``--model.attention_backend=choice`` (``auto``: the best that fits)."""
    if choice != "auto":
        return choice
    if context_parallel:
        return ContextParallel.name
    if mask_type == "causal":
        return SDPACausal.name
    return FlexDocument.name if device_type == "cuda" else DocumentSDPA.name


def select_backend(choice: str, mask_type: str, device_type: str, *, cp_mesh: DeviceMesh | None = None,
                   cpu_kernels: bool = False) -> AttentionBackend:
    """The one place a run's attention backend is chosen (preflight has refused what it cannot apply)."""
    name = backend_name(choice, mask_type, device_type, cp_mesh is not None)
    if name == ContextParallel.name:
        if cp_mesh is None:
            raise ValueError("the context_parallel attention backend needs the cp mesh")
        return ContextParallel(cp_mesh, cpu_kernels)
    if cp_mesh is not None:
        raise ValueError(f"the {name} attention backend does not apply context parallelism")
    return _local_backend(name, cpu_kernels)


def decoding_backend(backend: AttentionBackend) -> AttentionBackend:
    """The backend a decoding forward hands its blocks: ``backend`` (the run's) when it decodes against a
    cache, else the ``kv_cache`` backend with the same choice of CPU kernels (its rotation stays the run's)."""
    if backend.capabilities.kv_cache:
        return backend
    return _local_backend(KVCacheDecode.name, backend.cpu_kernels)


@functools.cache
def _local_backend(name: str, cpu_kernels: bool) -> AttentionBackend:
    # One object per choice: a compiled block guards on the backend it is passed, so a fresh one per
    # forward would recompile it.
    return BACKENDS[name](cpu_kernels)


def backend_problems(choice: str, needs: AttentionNeeds, device_type: str, context_parallel: bool) -> list[str]:
    """One line per capability the chosen backend lacks for this model and run (empty: it fits)."""
    name = backend_name(choice, needs.mask, device_type, context_parallel)
    caps, opt = BACKENDS[name].capabilities, f"--model.attention_backend={choice}"
    fix = "use --model.attention_backend=auto"
    gaps: list[str] = []
    if context_parallel and not caps.context_parallel:
        gaps.append("context parallelism (--parallelism.context_parallel_degree > 1)")
    if needs.mask not in caps.masks:
        gaps.append(f"the {needs.mask} mask (--model.attn_mask_type)")
    if device_type not in caps.devices:
        gaps.append(f"{device_type} devices (it runs on {', '.join(sorted(caps.devices))})")
    return [f"{opt}: the {name} attention backend does not apply {gap}; {fix}" for gap in gaps]


__all__ = ["BACKENDS", "BACKEND_CHOICES", "NO_EXTRAS", "AttentionBackend", "AttentionNeeds",
           "Capabilities", "ContextParallel", "DocumentSDPA", "FlexDocument", "KVCacheDecode", "SDPACausal",
           "ScoreExtras", "backend_name", "decoding_backend", "describe_backend", "describe_score_extras",
           "has_score_extras", "backend_problems", "select_backend"]

