"""Layout-invariant parameter initialization.

Each parameter's *full* value is a pure function of ``(seed, FQN, full shape)``,
independent of the parallel layout, the degrees, the device count and the rank.
The value is defined chunk by chunk along dim 0: chunk ``i`` holds a fixed number
of rows that depends only on the shape, and it is drawn on the CPU from a
generator seeded by a hash of ``(seed, FQN, i)``, following the model's
``param_init_specs()``. Each rank then keeps exactly its own shard, whatever its
DTensor placements, uneven shards included. So every layout starts from bitwise
the same model, and CPU and CUDA runs agree too.

This path governs *initialization* only. Runtime randomness (dropout, sampling)
keeps using the per-rank seeds of ``torchtitan.distributed.manual_seed``.

Peak cost, one parameter at a time:
- parameters split only along dim 0 (FSDP, HSDP, DDP): the chunks that overlap
  this rank's rows, one chunk (at most ``CHUNK_NUMEL`` float32 values, 16 MiB) at a time;
- other placements (e.g. TP column shards): the full parameter in float32 on the
  CPU (the 8B embedding: 128256 x 4096 x 4 B = 2.1 GB), never the whole model.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from typing import Protocol

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from torchtitan.compat import local_shape_and_global_offset
from torchtitan.distributed.init_spec import InitSpec, apply_init_spec

CHUNK_NUMEL = 1 << 22  # values per generator chunk: part of the definition, do not change lightly


def param_seed(seed: int, fqn: str, chunk: int) -> int:
    """A 63-bit generator seed for one chunk of one parameter, stable across runs and machines."""
    digest = hashlib.sha256(f"{seed}/{fqn}/{chunk}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def rows_per_chunk(shape: torch.Size) -> int:
    row_numel = math.prod(shape[1:]) if len(shape) > 1 else 1
    return max(1, CHUNK_NUMEL // max(row_numel, 1))


def init_rows(seed: int, fqn: str, shape: torch.Size, spec: InitSpec, start: int, stop: int) -> torch.Tensor:
    """Rows ``[start, stop)`` of the parameter's full float32 value (CPU)."""
    if len(shape) == 0:
        value = torch.empty((), dtype=torch.float32)
        return apply_init_spec(value, spec, generator=torch.Generator().manual_seed(param_seed(seed, fqn, 0)))
    rpc = rows_per_chunk(shape)
    pieces = []
    for chunk in range(start // rpc, (stop - 1) // rpc + 1 if stop > start else start // rpc):
        lo, hi = chunk * rpc, min((chunk + 1) * rpc, shape[0])
        generator = torch.Generator().manual_seed(param_seed(seed, fqn, chunk))
        values = apply_init_spec(torch.empty((hi - lo, *shape[1:]), dtype=torch.float32), spec, generator=generator)
        pieces.append(values[max(start, lo) - lo : min(stop, hi) - lo])
    if not pieces:
        return torch.empty((0, *shape[1:]), dtype=torch.float32)
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def _rows_only(param: DTensor) -> bool:
    return all(isinstance(p, Replicate) or (type(p) is Shard and p.dim == 0) for p in param.placements)


class InitSpecified(Protocol):
    """A module that names the initialization of each of its parameters (a decoder, a MoE layer)."""

    def param_init_specs(self) -> dict[str, InitSpec]: ...

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]: ...


@torch.no_grad()
def init_params_layout_invariant(model: InitSpecified, seed: int) -> None:
    """Fill every parameter of ``model`` (sharded or not) from its layout-free full value."""
    specs = model.param_init_specs()
    for fqn, param in model.named_parameters():
        spec, shape = specs[fqn], param.shape
        if not isinstance(param, DTensor):
            param.copy_(init_rows(seed, fqn, shape, spec, 0, shape[0] if shape else 1))
            continue
        local = param.to_local()
        if _rows_only(param):
            local_shape, offset = local_shape_and_global_offset(shape, param.device_mesh, param.placements)
            if local.numel():
                start = offset[0] if shape else 0
                local.copy_(init_rows(seed, fqn, shape, spec, start, start + local_shape[0]))
            continue
        # General placements: build the full value, then take this rank's part locally
        # (Replicate -> any placement is a slice on each rank; nothing is sent).
        full = init_rows(seed, fqn, shape, spec, 0, shape[0]).to(local.device)
        mesh = param.device_mesh
        replicated = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
        local.copy_(replicated.redistribute(mesh, param.placements).to_local())


def gather_full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full value on the CPU, from any layout (a collective: call on every rank).

    A debugging and testing tool: it holds the whole model on each rank.
    """
    out = {}
    for fqn, param in model.named_parameters():
        value = param.detach()
        if isinstance(value, DTensor):
            value = value.full_tensor()
        out[fqn] = value.cpu().clone()
    return out
