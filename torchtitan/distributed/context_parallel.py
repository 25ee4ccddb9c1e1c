"""Context parallelism: each ``cp`` rank holds a slice of the sequence.

Load balancing. Causal attention makes late tokens cost more than early ones (a
token attends to everything before it). The sequence is cut into ``2 * cp``
chunks; rank ``r`` holds chunk ``r`` (cheap) followed by chunk ``2*cp - 1 - r``
(expensive), so every rank does the same amount of attention work. Inputs,
labels and rotary positions are all sharded with this one layout
(``shard_sequence`` / ``local_positions``).

Attention. Each layer all-gathers the keys and values of the whole sequence over
``cp`` (as in the Llama 3 paper), then every local query chunk attends to the
keys up to its own end with a causal mask aligned to the bottom right. The
all-gather is differentiable (its backward is a reduce-scatter of the key/value
gradients), so forward and backward equal full attention. One code path serves
CPU (gloo) and CUDA (NCCL); what differs is the SDPA kernel behind it:

- eager: the mask is a ``causal_lower_right`` bias, which CUDA runs with the
  flash / memory-efficient kernels without materializing a mask, and CPU with
  its math kernel;
- under ``torch.compile`` (which cannot trace that bias object) the mask is an
  explicit boolean tensor, which CUDA runs with the memory-efficient kernel.

PyTorch's experimental ring attention (``context_parallel``) is not used: it has
no sharding rule for the CPU SDPA kernel, so CI could not test it, and all-gather
of K/V is exact and simple. Its cost is holding the full K/V of one layer, which
with grouped-query attention is small next to the activations.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.compat import functional_collectives as funcol
from torchtitan.compat import lower_right_causal_bias


def chunk_ids(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two global chunk indices (of ``2 * cp_size``) that ``cp_rank`` holds: head, tail."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def local_positions(seq_len: int, cp_rank: int, cp_size: int, device: torch.device | None = None) -> torch.Tensor:
    """Global token positions held by ``cp_rank``, in local order (head chunk then tail chunk)."""
    if seq_len % (2 * cp_size):
        raise ValueError(f"seq_len={seq_len} must be divisible by 2 * cp = {2 * cp_size} for load balancing")
    chunk = seq_len // (2 * cp_size)
    return torch.cat([torch.arange(g * chunk, (g + 1) * chunk, device=device) for g in chunk_ids(cp_rank, cp_size)])


def shard_sequence(x: torch.Tensor, cp_rank: int, cp_size: int, dim: int = 1) -> torch.Tensor:
    """This rank's load-balanced slice of ``x`` along ``dim`` (a copy, contiguous)."""
    chunks = x.chunk(2 * cp_size, dim=dim)
    if len(chunks) != 2 * cp_size or x.shape[dim] % (2 * cp_size):
        raise ValueError(f"sequence length {x.shape[dim]} must be divisible by 2 * cp = {2 * cp_size}")
    head, tail = chunk_ids(cp_rank, cp_size)
    return torch.cat([chunks[head], chunks[tail]], dim=dim)


def _global_order(cp_size: int, chunk: int, device: torch.device) -> torch.Tensor:
    """Index that turns the rank-ordered all-gather result into sequence order.

    After the all-gather, rank r's block [head_r, tail_r] sits at [2r*chunk, (2r+2)*chunk).
    """
    where = {}
    for r in range(cp_size):
        head, tail = chunk_ids(r, cp_size)
        where[head], where[tail] = 2 * r, 2 * r + 1
    blocks = [torch.arange(where[g] * chunk, (where[g] + 1) * chunk, device=device) for g in range(2 * cp_size)]
    return torch.cat(blocks)


def _causal_mask(n_q: int, n_kv: int, device: torch.device) -> torch.Tensor:
    """Boolean mask [n_q, n_kv]: query i sees keys up to i + (n_kv - n_q) (bottom-right aligned)."""
    return torch.ones(n_q, n_kv, dtype=torch.bool, device=device).tril(diagonal=n_kv - n_q)


@functools.lru_cache(maxsize=64)
def _lower_right_bias(seq_len_q: int, seq_len_kv: int) -> torch.Tensor:
    """A lower-right causal bias, built once per shape (with no storage: compat/kernels.py says why). It is a
    Tensor subclass, which cannot be created while a TorchDispatchMode is active (the
    communication counter of benchmarks/footprint.py is one)."""
    return lower_right_causal_bias(seq_len_q, seq_len_kv)


def gather_sequence(x: torch.Tensor, mesh: DeviceMesh, dim: int) -> torch.Tensor:
    """All-gather every CP rank's load-balanced slice of ``x`` along ``dim`` and return it in sequence order.

    Differentiable: the backward reduce-scatters the gradient back to each rank's slice.
    """
    whole = funcol.all_gather_tensor_autograd(x, gather_dim=dim, group=mesh.get_group())
    order = _global_order(mesh.size(), x.shape[dim] // 2, x.device)
    return whole.index_select(dim, order)


# (local query chunk, its global index g, the keys and values up to the chunk's end) -> its output
ChunkScore = Callable[[torch.Tensor, int, torch.Tensor, torch.Tensor], torch.Tensor]


def attend_chunks(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, mesh: DeviceMesh,
                  score: ChunkScore) -> torch.Tensor:
    """The one context-parallel loop: each of this rank's two load-balanced query chunks attends to the
    whole sequence's keys up to its own end (``score`` applies the mask); their outputs, in local order.

    q: [B, H, L_local, D]; k_all, v_all: the gathered keys and values [B, H_kv, L, D] (``gather_sequence``).
    """
    chunk = q.shape[2] // 2
    outs = []
    for local, g in enumerate(chunk_ids(mesh.get_local_rank(), mesh.size())):
        n_kv = (g + 1) * chunk  # keys up to the end of this chunk
        outs.append(score(q[:, :, local * chunk : (local + 1) * chunk], g, k_all[:, :, :n_kv], v_all[:, :, :n_kv]))
    return torch.cat(outs, dim=2)


def _causal_chunk(q_chunk: torch.Tensor, g: int, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    chunk, n_kv = q_chunk.shape[2], k.shape[2]
    if torch.compiler.is_compiling():
        mask = _causal_mask(chunk, n_kv, q_chunk.device)
    else:
        mask = _lower_right_bias(chunk, n_kv)
    return F.scaled_dot_product_attention(q_chunk, k, v, attn_mask=mask)


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Causal attention of local queries against the whole sequence's keys/values.

    q, k, v: [B, H, L_local, D] in this rank's load-balanced layout (k and v may
    have fewer heads than q: grouped-query attention; they are repeated after the
    all-gather so the communication stays at the K/V head count). v's head size may
    differ from q's and k's. Returns [B, H, L_local, D_v] in the same layout.
    """
    k_all, v_all = gather_sequence(k.contiguous(), mesh, dim=2), gather_sequence(v.contiguous(), mesh, dim=2)
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1:
        k_all, v_all = k_all.repeat_interleave(n_rep, dim=1), v_all.repeat_interleave(n_rep, dim=1)
    return attend_chunks(q, k_all, v_all, mesh, _causal_chunk)
