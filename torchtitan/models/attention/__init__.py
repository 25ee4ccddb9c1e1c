"""Attention: the masks (``masks``), the score kernels that apply them (``kernels``), the backends that choose
among the kernels, with their capabilities (``backends``), and the attention module a block is given
(``gqa``). docs/models.md and docs/attention_masks.md describe them."""

from torchtitan.models.attention.backends import (
    BACKEND_CHOICES,
    BACKENDS,
    NO_EXTRAS,
    AttentionBackend,
    AttentionNeeds,
    Capabilities,
    ContextParallel,
    DocumentSDPA,
    FlexDocument,
    KVCacheDecode,
    ScoreExtras,
    SDPACausal,
    backend_name,
    backend_problems,
    decoding_backend,
    describe_backend,
    select_backend,
)
from torchtitan.models.attention.gqa import GQAConfig, GroupedQueryAttention
from torchtitan.models.attention.kernels import block_causal_attention, cp_block_causal_attention, per_document_sdpa
from torchtitan.models.attention.masks import (
    MASK_TYPES,
    DocumentMask,
    build_document_mask,
    check_mask_type,
    cp_document_mask,
    dense_mask,
    document_causal_mask_mod,
    document_ids,
)

__all__ = ["BACKENDS", "BACKEND_CHOICES", "MASK_TYPES", "NO_EXTRAS", "AttentionBackend", "AttentionNeeds",
           "Capabilities", "ContextParallel", "DocumentMask", "DocumentSDPA", "FlexDocument", "GQAConfig",
           "GroupedQueryAttention", "KVCacheDecode", "SDPACausal", "ScoreExtras", "backend_name", "backend_problems",
           "block_causal_attention", "build_document_mask", "check_mask_type", "cp_block_causal_attention",
           "cp_document_mask", "decoding_backend", "dense_mask", "describe_backend", "document_causal_mask_mod",
           "document_ids", "per_document_sdpa", "select_backend"]
