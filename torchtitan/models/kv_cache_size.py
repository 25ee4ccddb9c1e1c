"""What the decoding cache (``kv_cache.py``) holds per token, from a model's arguments alone.

Per layer, grouped-query attention (Llama 3, Qwen3, Mixtral, and GPT-OSS's sink attention) keeps a key and a
value of ``head_dim`` for each key/value head. Multi-head latent attention (DeepSeek-V3, Kimi K2) keeps the
normalised latent and the shared rotary key (``kv_lora_rank + qk_rope_head_dim`` values), not the per-head keys
and values it expands them to at every step; ``expanded`` is what a cache of those would hold. The cache keeps
every slot of a sliding-window layer too (the window is a mask over them); ``window_bounded`` is what it would
hold if such a layer kept only its last ``window`` tokens.

The counts are one process's. Under tensor parallelism a rank holds its own heads' share of a grouped-query
cache, and the whole latent of an MLA cache (the latent path is not sharded).
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan.models.attention import GQAConfig
from torchtitan.models.common.config import AttentionConfig, DecoderConfig
from torchtitan.models.deepseek_v3.mla import MLAConfig
from torchtitan.models.gpt_oss.args import GptOssArgs
from torchtitan.models.gpt_oss.attention import SinkAttentionConfig


@dataclass(frozen=True)
class LayerCacheSize:
    """One layer's cache per token: ``held`` values (what ``LayerCache`` allocates), ``expanded`` values (keys
    and values of every key/value head), and the sliding ``window`` (None: the layer reads every slot)."""

    held: int
    expanded: int
    window: int | None = None


def layer_cache_sizes(args: DecoderConfig) -> list[LayerCacheSize]:
    """Each decoder layer's cache per token, in layer order (the multi-token prediction modules never decode)."""
    if isinstance(args, GptOssArgs):  # its layers differ by their window
        return [_size(args.layer_attention(i)) for i in range(args.n_layers)]
    return [_size(args.attention())] * args.n_layers


def _size(attention: AttentionConfig) -> LayerCacheSize:
    if isinstance(attention, MLAConfig):
        return LayerCacheSize(held=attention.kv_lora_rank + attention.qk_rope_head_dim,
                              expanded=attention.n_heads * (attention.head_dim + attention.v_head_dim))
    if isinstance(attention, (GQAConfig, SinkAttentionConfig)):
        keys_and_values = 2 * attention.n_kv_heads * attention.head_dim
        window = attention.window if isinstance(attention, SinkAttentionConfig) else None
        return LayerCacheSize(held=keys_and_values, expanded=keys_and_values, window=window)
    raise TypeError(f"no cache size is known for the attention {type(attention).__name__}")


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
