"""The decoder-only transformer that the families share: embedding, blocks, final norm, output.

Written to be easy to parallelise:
- `layers` is a ModuleDict keyed by the original layer index, and the embedding, final norm and
  output projection may be None, so pipeline stages can prune the model and still keep the
  original parameter names;
- initialisation is described by each family's `param_init_specs()` (one spec per parameter), the
  single source of truth for both plain and sharded initialisation;
- a family gives the blocks (``block(layer_id, args)``); its args provide ``vocab_size``, ``dim``,
  ``n_layers``, ``norm_eps``, ``head_dim``, ``rope_theta``, ``rope_scaling_params()``,
  ``max_seq_len``, ``tie_word_embeddings`` and ``attn_mask_type``.
"""

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torchtitan.distributed.init_spec import InitSpec, apply_init_spec
from torchtitan.models.attention import AttentionBackend, DocumentMask, build_document_mask
from torchtitan.models.kv_cache import KVCache
from torchtitan.models.layers import RMSNorm, precompute_rope_cache


class Decoder(nn.Module):
    """Embedding -> blocks (``layers``) -> final norm -> output projection; see the module docstring.

    ``block(layer_id, args)`` builds each block; subclasses give ``param_init_specs``.
    """

    def __init__(self, args: Any, block: Callable[[int, Any], nn.Module]):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): block(i, args) for i in range(args.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(args.dim, args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()
        self.attention_backend: AttentionBackend | None = None  # see use_attention_backend
        # Non-persistent: it is derived from args, so it stays out of checkpoints.
        self.register_buffer("rope_cache", self._rope_cache(device=None), persistent=False)

    def tie_weights(self) -> None:
        """With ``tie_word_embeddings``, make the output projection's weight the embedding's (one parameter).

        Called again wherever a step may have given the two modules separate copies: tensor
        parallelism distributes each module's weight on its own, and ``to_empty`` of plain
        tensors allocates per module. Both modules shard the vocabulary dim (rows) under TP,
        so the embedding's placement serves the output too. A pipeline stage holding only
        one of them has nothing to tie.
        """
        if self.args.tie_word_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def to_empty(self, *, device: torch.device | str | None, recurse: bool = True) -> "Decoder":
        super().to_empty(device=device, recurse=recurse)
        self.tie_weights()
        return self

    def _rope_cache(self, device: torch.device | None) -> torch.Tensor:
        a = self.args
        return precompute_rope_cache(a.head_dim, a.max_seq_len, a.rope_theta, a.rope_scaling_params(), device)

    def param_init_specs(self) -> dict[str, InitSpec]:
        raise NotImplementedError

    @torch.no_grad()
    def init_buffers(self, buffer_device: torch.device | None = None) -> None:
        """Recompute the (non-persistent) rope cache, e.g. after ``to_empty``."""
        device = buffer_device if buffer_device is not None else self.rope_cache.device
        self.rope_cache = self._rope_cache(device)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Recompute the rope cache, then fill every parameter from param_init_specs()."""
        self.init_buffers(buffer_device)
        specs = self.param_init_specs()
        for fqn, param in self.named_parameters():
            apply_init_spec(param, specs[fqn])

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        """tokens: ids [B, L] (or hidden states [B, L, dim] on a stage without embeddings).

        positions: [L] or [B, L] indices into the rope cache; None means 0..L-1. Under the
        ``block_causal`` mask they also delimit the documents: each restarts at 0 at a
        document's first token (None: every row is one document).
        cache: decoding (models/kv_cache.py): ``tokens`` are the rows' next tokens after those the
        cache holds, which gives their positions and mask; training never passes one.
        Returns logits [B, L, vocab] (hidden states on a stage without output).
        """
        if cache is not None:
            return self._forward_cached(tokens, cache)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        # Attention slices the cache to its own length: under sequence parallelism h holds only
        # part of the sequence here, while attention sees all of it.
        rope = self.rope_cache if positions is None else self.rope_cache[positions]
        documents = None
        if self.args.attn_mask_type == "block_causal" and positions is not None:
            documents = self.document_mask(positions, tokens.shape[0])  # once per forward, shared by the layers
        for layer in self.layers.values():
            h = layer(h, rope, documents=documents)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h

    def _forward_cached(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One decoding forward: the new tokens attend to the cache's keys; each layer appends its own."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        rope = self.rope_cache[cache.begin(tokens.shape[1])]
        for key, layer in self.layers.items():
            h = layer(h, rope, cache=cache.layer(key))
        cache.advance(tokens.shape[1])
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h

    def use_attention_backend(self, backend: AttentionBackend) -> None:
        """Make every attention layer, and the document mask of each forward, go through ``backend``
        (context parallelism selects ``ContextParallelAttention``)."""
        self.attention_backend = backend
        for layer in self.layers.values():
            # nn.Module.__setattr__ is typed for tensors and modules; any attribute is allowed.
            layer.attention.backend = backend  # pyright: ignore[reportAttributeAccessIssue, reportArgumentType]

    def document_mask(self, positions: torch.Tensor, batch: int) -> DocumentMask:
        """The documents of this forward's rows: of the whole sequence under an attention backend."""
        if self.attention_backend is not None:
            return self.attention_backend.document_mask(positions, batch)
        return build_document_mask(positions, batch)

    def num_params(self, exclude_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())  # a tied weight is counted once
        if exclude_embedding and self.tok_embeddings is not None:
            n -= self.tok_embeddings.weight.numel()
        return n


