"""What the decoding cache (``kv_cache.py``) holds, from a model's arguments alone.

Each attention config states its layer's share per token (``cache_size``, a ``LayerCacheSize``).
Grouped-query attention (Llama 3, Qwen3, Mixtral, and GPT-OSS's sink attention) keeps a key and a value of
``head_dim`` for each key/value head. Multi-head latent attention (DeepSeek-V3, Kimi K2) keeps the normalised
latent and the shared rotary key (``kv_lora_rank + qk_rope_head_dim`` values), not the per-head keys and values
it expands them to at every step; ``expanded`` is what a cache of those would hold. The cache keeps every slot
of a sliding-window layer too (the window is a mask over them); ``window_bounded`` is what it would hold if
such a layer kept only its last ``window`` tokens.

The counts are one process's. Under tensor parallelism a rank holds its own heads' share of a grouped-query
cache, and the whole latent of an MLA cache (the latent path is not sharded).
"""

from __future__ import annotations

from torchtitan.models.common.config import DecoderConfig
from torchtitan.models.kv_cache import LayerCacheSize


def layer_cache_sizes(args: DecoderConfig) -> list[LayerCacheSize]:
    """Each decoder layer's cache per token, in layer order (multi-token prediction modules never decode)."""
    return [args.layer_attention(i).cache_size() for i in range(args.n_layers)]


def cache_bytes(args: DecoderConfig, tokens: int, element_bytes: int, *, expanded: bool = False,
                window_bounded: bool = False) -> int:
    """Bytes of every layer's cache for ``tokens`` slots (batch rows times capacity) of ``element_bytes`` each:
    what the project's cache allocates, or with ``expanded`` the per-head keys and values, or with
    ``window_bounded`` sliding layers limited to their window (``tokens`` is then one row's context)."""
    total = 0
    for layer in layer_cache_sizes(args):
        slots = min(tokens, layer.window) if window_bounded and layer.window is not None else tokens
        total += slots * (layer.expanded if expanded else layer.held)
    return total * element_bytes
