from torchtitan.distributed.parallel_dims import FLATTENED_VIEWS, MESH_DIM_NAMES, ParallelDims
from torchtitan.distributed.seeding import manual_seed, set_determinism
from torchtitan.distributed.utils import clip_grad_norm_, device_type, init_distributed, reduce_scalar

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
