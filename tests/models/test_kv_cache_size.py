"""``models/kv_cache_size.py`` against the decoding cache itself: after a prefill of tiny models of every
attention kind, the bytes the function predicts are the bytes the cache's tensors hold."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from torchtitan.models import get_model_spec, model_args
from torchtitan.models.deepseek_v3.model import DeepSeekV3Model
from torchtitan.models.kv_cache import KVCache
from torchtitan.models.kv_cache_size import cache_bytes, layer_cache_sizes

ROWS, CAPACITY, PROMPT = 2, 24, 10


def _prefilled(name: str, flavor: str, dtype: torch.dtype) -> tuple[torch.nn.Module, KVCache]:
    """A 2-layer model of ``name``'s debug flavor (GPT-OSS: one sliding and one full layer), its cache after
    one prefill of ``PROMPT`` tokens in ``ROWS`` rows."""
    extra = {"layer_types": ()} if name == "gpt_oss" else {}  # () is the releases' alternation for 2 layers
    args = dataclasses.replace(model_args(name, flavor), n_layers=2, max_seq_len=64, **extra)
    torch.manual_seed(0)
    model = get_model_spec(name).build(args).to(dtype)
    cache = KVCache(torch.zeros(ROWS, dtype=torch.long), CAPACITY)
    with torch.no_grad():
        model(torch.randint(0, args.vocab_size, (ROWS, PROMPT)), cache=cache)
    return model, cache


def _held_bytes(model: torch.nn.Module, cache: KVCache) -> int:
    total = 0
    for key in model.layers:  # type: ignore[union-attr]  # every decoder has its blocks by name
        layer = cache.layer(key)
        assert layer.k is not None and layer.v is not None
        total += layer.k.nbytes + layer.v.nbytes
    return total


@pytest.mark.parametrize(("name", "flavor", "dtype"), [
    ("llama3", "debugmodel", torch.float32), ("qwen3", "debugmodel", torch.bfloat16),
    ("deepseek_v3", "debugmodel", torch.float32), ("gpt_oss", "debugmodel", torch.bfloat16)])
def test_predicted_bytes_are_the_cache_tensors_bytes(name, flavor, dtype):
    model, cache = _prefilled(name, flavor, dtype)
    args = model.args  # type: ignore[union-attr]
    assert _held_bytes(model, cache) == cache_bytes(args, ROWS * CAPACITY, dtype.itemsize)


def test_mla_holds_the_latent_and_expands_to_every_heads_keys_and_values():
    model, cache = _prefilled("deepseek_v3", "debugmodel", torch.float32)
    assert isinstance(model, DeepSeekV3Model)
    args = model.args
    first = layer_cache_sizes(args)[0]
    assert first.held == args.kv_lora_rank + args.qk_rope_head_dim
    latent, k_rope = cache.layer("0").k, cache.layer("0").v
    assert latent is not None and k_rope is not None
    # what the layer expands the held slots to at each step: per token, every head's key and value
    k, v = model.layers["0"].attention.expand(latent.squeeze(1), k_rope.transpose(1, 2))
    assert (k.numel() + v.numel()) * 4 == cache_bytes(args, ROWS * CAPACITY, 4, expanded=True) // args.n_layers
    assert first.expanded > 4 * first.held  # the point of the latent


def test_sliding_layers_bound_only_the_window_bounded_count():
    args = model_args("gpt_oss", "debugmodel")  # 4 layers: sliding (window 16), full, sliding, full
    per_layer = 2 * args.n_kv_heads * args.head_dim
    assert [s.window for s in layer_cache_sizes(args)] == [16, None, 16, None]
    assert cache_bytes(args, 64, 2) == 4 * 64 * per_layer * 2
    assert cache_bytes(args, 64, 2, window_bounded=True) == (2 * 64 + 2 * 16) * per_layer * 2
    assert cache_bytes(args, 8, 2, window_bounded=True) == cache_bytes(args, 8, 2)  # shorter than the window
