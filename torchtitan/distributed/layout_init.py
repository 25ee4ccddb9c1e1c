"""Layout-invariant parameter initialization.

Each parameter's *full* value is a pure function of ``(seed, FQN, full shape)``:
it is drawn on the CPU from a generator seeded by a hash of the seed and the
parameter's name, following the model's ``param_init_specs()``. Each rank then
keeps exactly its own shard of that value, whatever the DTensor placements
(FSDP, HSDP, DDP and, as they land, TP/CP/PP). So every layout, degree and device
count starts from bitwise the same model, and CPU and CUDA agree too.

This path governs *initialization* only. Runtime randomness (dropout, sampling)
keeps using the per-rank seeds of ``torchtitan.distributed.manual_seed``.

Cost: one full parameter at a time in float32 on the CPU of every rank, so the
peak is the largest parameter (e.g. the 8B embedding: 128256 x 4096 x 4 B = 2.1 GB),
never the whole model.
"""

from __future__ import annotations

import hashlib

import torch
from torch.distributed.tensor import DTensor, Replicate


def param_seed(seed: int, fqn: str) -> int:
    """A 63-bit generator seed for one parameter, stable across runs and machines."""
    digest = hashlib.sha256(f"{seed}/{fqn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def full_init_value(seed: int, fqn: str, shape: torch.Size, spec, apply_spec) -> torch.Tensor:
    """The full float32 value of one parameter (CPU)."""
    generator = torch.Generator(device="cpu").manual_seed(param_seed(seed, fqn))
    return apply_spec(torch.empty(shape, dtype=torch.float32), spec, generator=generator)


def local_shard(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``full`` under ``param``'s placements (no communication)."""
    if not isinstance(param, DTensor):
        return full
    mesh = param.device_mesh
    replicated = DTensor.from_local(full.to(param.device), mesh, [Replicate()] * mesh.ndim, run_check=False)
    # Replicate -> Shard is a local slice on every rank: nothing is sent.
    return replicated.redistribute(mesh, param.placements).to_local()


@torch.no_grad()
def init_params_layout_invariant(model: torch.nn.Module, seed: int) -> None:
    """Fill every parameter of ``model`` (sharded or not) from its layout-free full value."""
    from torchtitan.models.llama3.model import apply_init_spec

    specs = model.param_init_specs()
    for fqn, param in model.named_parameters():
        full = full_init_value(seed, fqn, param.shape, specs[fqn], apply_init_spec)
        target = param.to_local() if isinstance(param, DTensor) else param
        target.copy_(local_shard(full, param))
