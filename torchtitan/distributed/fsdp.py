"""FSDP2 over a model's blocks and root: FSDP, HSDP, DDP, and the mixed-precision policy.

The blocks are ``model.layers`` (the contract of ``torchtitan/models/spec.py``): each is one FSDP
unit, and the root (embeddings, final norm, output) is the last one. Under expert parallelism each
block's experts are a unit of their own, sharded over the ``efsdp`` ranks that hold the same experts
(replicated over ``dp_replicate`` under HSDP), the rest of the block over the dense mesh.
"""

from __future__ import annotations

import logging

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from torchtitan.config import JobConfig
from torchtitan.config.dtypes import DTYPES
from torchtitan.config.job_config import Training
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.spec import family_model

logger = logging.getLogger(__name__)


def mixed_precision(training: Training, device_type: str) -> MixedPrecisionPolicy:
    """The compute (param) and gradient-reduction dtypes of ``training`` on ``device_type``."""
    param = training.mixed_precision_param
    if param == "auto":
        # bf16 compute is the norm on GPUs; CPUs run bf16 matmuls slowly, so they default to float32.
        param = "bfloat16" if device_type == "cuda" else "float32"
    return MixedPrecisionPolicy(param_dtype=DTYPES[param], reduce_dtype=DTYPES[training.mixed_precision_reduce])


def reshard_after_forward(policy: str, pp_enabled: bool) -> bool:
    if policy == "always":
        return True
    if policy == "never":
        return False
    # With PP every microbatch would re-gather the parameters it just freed.
    return not pp_enabled


def apply_fsdp(model: torch.nn.Module, dims: ParallelDims, cfg: JobConfig, device_type: str,
               mesh: DeviceMesh | None = None, experts: list[torch.nn.Module] | None = None) -> None:
    """Shard each block, then the root (embeddings, final norm, output).

    The mesh is 1-D ``dp_shard_cp`` for FSDP, 2-D ``(dp_replicate, dp_shard_cp)``
    for HSDP (shard within a replica group, all-reduce across groups), and for DDP
    a 2-D ``(dp_replicate, dp_shard=1)`` mesh: FSDP2 then keeps whole parameters
    and all-reduces gradients, which is DDP with the same code path, parameter
    type (DTensor), mixed precision and checkpoint format as FSDP and HSDP.
    ``experts``: the expert-parallel expert modules (``ParallelDims.expert_fsdp_mesh``).
    """
    family = family_model(model, "apply_fsdp")
    mesh = mesh if mesh is not None else dims.fsdp_mesh()
    assert mesh is not None, "parallelize applies FSDP only where fsdp_mesh() builds one"
    mp = mixed_precision(cfg.training, device_type)
    reshard = reshard_after_forward(cfg.parallelism.fsdp_reshard_after_forward, dims.pp_enabled)
    # Blocks that run after ``layers`` (DeepSeek-V3's multi-token prediction modules) are units of their own,
    # so that their expert-parallel experts get their own unit too.
    blocks = [*family.blocks(), *family.extra_blocks()]
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: keep them gathered.
        last = i == len(blocks) - 1 and cfg.parallelism.fsdp_reshard_after_forward == "default"
        for unit in experts or ():
            if any(m is unit for m in block.modules()):
                _shard_experts(unit, dims, mp, reshard and not last)
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard and not last)
    # The root (embeddings, final norm, output) runs last in forward and first in backward, so
    # resharding it only re-gathers it at once. FSDP2 skips that only when the root's value is
    # left unset, and torch 2.13 honours an explicit True: it cost one extra all-gather of the
    # root per step (measured: benchmarks/history.md section 2, "FSDP root resharding").
    root_reshard = reshard and cfg.parallelism.fsdp_reshard_after_forward != "default"
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=root_reshard)
    if mesh.size() == 1:
        kind = "FSDP on one rank (mixed precision only)"
    else:
        kind = "DDP" if not dims.fsdp_enabled else ("HSDP" if dims.dp_replicate_enabled else "FSDP")
    assert mesh.mesh_dim_names is not None, "build_mesh names every dim"
    logger.info("Applied %s on mesh %s (param %s, reduce %s)", kind, dict(zip(mesh.mesh_dim_names, mesh.shape)),
                mp.param_dtype, mp.reduce_dtype)


def _shard_experts(experts: torch.nn.Module, dims: ParallelDims, mp: MixedPrecisionPolicy, reshard: bool) -> None:
    """One FSDP unit for a layer's expert-parallel experts, over ``efsdp`` (and ``dp_replicate``).

    FSDP averages their gradients over those ranks, as it averages the dense weights' over all data
    ranks; the experts' own ``1 / ep`` (``models/moe/parallel.py``) makes the two agree. When a
    rank's experts are fewer than the ``efsdp`` ranks, FSDP shards their rows instead (no padding).
    """
    mesh = dims.expert_fsdp_mesh()
    num_experts = experts.num_experts  # GroupedExperts' global count (models/moe/experts.py)
    if not isinstance(num_experts, int):  # nn.Module's stubs type every attribute as Tensor | Module
        raise TypeError(f"expert parallelism: {type(experts).__name__}.num_experts is not an int; FSDP shards the "
                        "MoE layers' GroupedExperts that apply_ep returns")
    local_experts = num_experts // dims.ep
    dim = 0 if local_experts % dims.degree("efsdp") == 0 else 1
    fully_shard(experts, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard,
                shard_placement_fn=lambda param: Shard(dim))
