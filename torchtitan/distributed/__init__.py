from torchtitan.distributed.collectives import reduce_scalar
from torchtitan.distributed.grads import clip_grad_norm_
from torchtitan.distributed.lifecycle import device_type, init_distributed
from torchtitan.distributed.parallel_dims import FLATTENED_VIEWS, MESH_DIM_NAMES, ParallelDims
from torchtitan.distributed.seeding import manual_seed, set_determinism

__all__ = [
    "FLATTENED_VIEWS",
    "MESH_DIM_NAMES",
    "ParallelDims",
    "manual_seed",
    "set_determinism",
    "clip_grad_norm_",
    "device_type",
    "init_distributed",
    "reduce_scalar",
]
