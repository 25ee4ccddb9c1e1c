"""The keys and values of earlier tokens, kept across the forwards of autoregressive decoding.

Generation (``torchtitan/generation``) passes a ``KVCache`` to a model's forward as
``cache=``; training never does, and then the model runs exactly as before. A forward with a
cache processes only the new tokens: each attention layer appends their keys and values to
its slots and attends to every filled slot. So the cost of a new token grows with the
context only through attention over the cached keys, not with a recompute of the whole
prompt.

Rows of a batch are left-padded to one length: row ``b`` starts with ``pad[b]`` padding
slots, which no query attends to, and its rotary positions start at 0 after them (as if
the row were alone). The cache owns that bookkeeping (``begin``): one mask and one set of
positions per forward, shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerCacheSize:
    """What one layer's cache keeps per token (an attention config's ``cache_size``): ``held`` values (what
    ``LayerCache`` allocates), ``expanded`` values (keys and values of every key/value head, which MLA computes
    from what it holds), and the sliding ``window`` (None: the layer reads every slot)."""

    held: int
    expanded: int
    window: int | None = None


class LayerCache:
    """One attention layer's slots: ``[B, kv_heads, capacity, head_dim]`` keys and ``[B, kv_heads, capacity,
    v_head_dim]`` values.

    Each is allocated on the first write, from the shape the layer writes it with: under tensor
    parallelism a rank holds only its local heads, and the value head size may differ from the key's
    (multi-head latent attention).
    """

    def __init__(self, owner: KVCache) -> None:
        self.owner = owner
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def mask(self) -> torch.Tensor:
        """[B, 1, new, filled] booleans, True where a query may attend (``KVCache.begin``)."""
        return self.owner.mask

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new tokens' ``k`` [B, kv_heads, new, head_dim] and ``v`` [B, kv_heads, new, v_head_dim];
        all filled slots' keys and values."""
        start, end = self.owner.length, self.owner.length + k.shape[2]
        if self.k is None or self.v is None:  # each its own width: values may be narrower than keys (MLA)
            self.k = k.new_zeros(k.shape[0], k.shape[1], self.owner.capacity, k.shape[3])
            self.v = v.new_zeros(v.shape[0], v.shape[1], self.owner.capacity, v.shape[3])
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


class KVCache:
    """Every layer's keys and values for a batch of left-padded rows, ``capacity`` slots long."""

    def __init__(self, pad: torch.Tensor, capacity: int) -> None:
        self.pad = pad  # [B] padding slots at the start of each row
        self.capacity = capacity
        self.length = 0  # slots filled so far
        self.mask = torch.empty(0, dtype=torch.bool)
        self._layers: dict[str, LayerCache] = {}

    def layer(self, key: str) -> LayerCache:
        if key not in self._layers:
            self._layers[key] = LayerCache(self)
        return self._layers[key]

    def begin(self, new: int) -> torch.Tensor:
        """Prepare a forward of ``new`` tokens per row: sets the mask; returns their rotary positions [B, new].

        A query attends to the filled and new slots up to its own, except the row's padding. A
        padding query attends to itself alone, so that its (unused) output stays finite.
        """
        if self.length + new > self.capacity:
            raise ValueError(f"the cache holds {self.capacity} tokens; {self.length} + {new} do not fit")
        device = self.pad.device
        slots = torch.arange(self.length, self.length + new, device=device)
        keys = torch.arange(self.length + new, device=device)
        causal = keys[None, :] <= slots[:, None]  # [new, filled]
        real = keys[None, :] >= self.pad[:, None]  # [B, filled]
        self.mask = ((causal[None] & real[:, None]) | (keys[None, :] == slots[:, None])[None])[:, None]
        return (slots[None, :] - self.pad[:, None]).clamp(min=0)

    def advance(self, new: int) -> None:
        """The forward's ``new`` tokens are written in every layer."""
        self.length += new
