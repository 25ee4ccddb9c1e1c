"""Parallelism degrees, their validation, and the one world ``DeviceMesh``.

The world mesh has one dim per *enabled* parallelism (degree > 1), laid out as
``pp, dp_replicate, dp_shard, cp, tp`` (outermost first, so that TP — the most
communication-hungry — gets neighbouring ranks, i.e. one node's fast links).
Three flattened views are added for the jobs that span several dims:

- ``dp``          = (dp_replicate, dp_shard): ranks that read different data
- ``dp_shard_cp`` = (dp_shard, cp): the ranks FSDP shards parameters over
- ``dp_cp``       = (dp_replicate, dp_shard, cp): the ranks the loss is averaged over

A view made of a single enabled dim is that dim itself, and a view with no enabled
dim does not exist; ``ParallelDims.get_mesh(name)`` resolves all of these so callers
never need to know which case they are in.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchtitan.compat import flatten_mesh


# The mesh dimension names, in the order the world mesh lays them out.
def dp_shard_problem(dp_shard: int) -> str | None:
    """What is wrong with a dp_shard degree on its own (before the world size is known), or None."""
    if dp_shard == 0 or dp_shard < -1:
        return "use -1 (the ranks left over) or a degree >= 1"
    return None


MESH_DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# Flattened view name -> the mesh dims it spans (in mesh order).
FLATTENED_VIEWS = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    world_size: int
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    _views: dict[str, DeviceMesh] = field(default_factory=dict, init=False, repr=False)
    _unit_root: DeviceMesh | None = field(default=None, init=False, repr=False)
    _loss_parallel: bool = field(default=True, init=False, repr=False)

    def __post_init__(self) -> None:
        self._validate()

    def _degrees_text(self) -> str:
        return (
            f"dp_replicate={self.dp_replicate}, dp_shard={self.dp_shard}, cp={self.cp}, "
            f"tp={self.tp}, pp={self.pp}, world_size={self.world_size}"
        )

    def _validate(self) -> None:
        degrees = {"dp_replicate": self.dp_replicate, "cp": self.cp, "tp": self.tp, "pp": self.pp}
        for name, value in [*degrees.items(), ("dp_shard", self.dp_shard), ("world_size", self.world_size)]:
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"ParallelDims: {name}={value!r} must be an int ({self._degrees_text()})")
        if self.world_size < 1:
            raise ValueError(f"ParallelDims: world_size must be >= 1 ({self._degrees_text()})")
        for name, value in degrees.items():
            if value < 1:
                raise ValueError(
                    f"ParallelDims: {name}={value} is invalid; every degree but dp_shard must be >= 1 "
                    f"({self._degrees_text()})"
                )
        problem = dp_shard_problem(self.dp_shard)
        if problem:
            raise ValueError(f"ParallelDims: dp_shard={self.dp_shard} is invalid; {problem} ({self._degrees_text()})")
        others = self.dp_replicate * self.cp * self.tp * self.pp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ValueError(
                    f"ParallelDims: dp_shard=-1 needs world_size divisible by dp_replicate*cp*tp*pp={others}, "
                    f"but world_size={self.world_size} ({self._degrees_text()}); change the degrees or the "
                    f"number of processes"
                )
            self.dp_shard = self.world_size // others
        product = others * self.dp_shard
        if product != self.world_size:
            raise ValueError(
                f"ParallelDims: dp_replicate*dp_shard*cp*tp*pp = {product} but world_size = {self.world_size} "
                f"({self._degrees_text()}); make the product equal the number of processes, or set "
                f"data_parallel_shard_degree=-1 to give dp_shard the ranks left over"
            )

    # ---- the mesh ---------------------------------------------------------
    def degree(self, name: str) -> int:
        """Size of a mesh dim or flattened view (1 when it is disabled)."""
        dims = FLATTENED_VIEWS.get(name, (name,))
        size = 1
        for d in dims:
            size *= getattr(self, d)
        return size

    @property
    def enabled_dims(self) -> list[str]:
        """Mesh dim names with degree > 1, in mesh order."""
        return [d for d in MESH_DIM_NAMES if getattr(self, d) > 1]

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Build the world mesh and its flattened views (a collective: call on every rank)."""
        names = self.enabled_dims
        if not names:
            # A DeviceMesh needs at least one dim; a single rank is a shard group of one.
            names = ["dp_shard"]
        mesh = init_device_mesh(device_type, tuple(self.degree(d) for d in names), mesh_dim_names=tuple(names))
        self._views = {}
        for view, dims in FLATTENED_VIEWS.items():
            present = [d for d in dims if d in names]
            # One dim is already its own view; flattening it again would only add an alias.
            # Keep the flattened meshes: slicing them back off the root mesh is deprecated.
            if len(present) >= 2:
                self._views[view] = flatten_mesh(mesh[tuple(present)], view)
        self._mesh = mesh
        return mesh

    @property
    def world_mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("ParallelDims.build_mesh() has not been called yet")
        return self._mesh

    def mesh_name(self, name: str) -> str | None:
        """The name to index the world mesh with for a dim or view (None when disabled).

        A view spanning one enabled dim is that dim; one spanning several is the
        flattened view built by ``build_mesh``.
        """
        own_names = self.world_mesh.mesh_dim_names or ()
        if name in own_names:
            return name
        present = [d for d in FLATTENED_VIEWS.get(name, (name,)) if d in own_names]
        if not present:
            return None
        return present[0] if len(present) == 1 else name

    def get_mesh(self, name: str) -> DeviceMesh | None:
        """The 1-D mesh for a dim or flattened view; None when none of its dims is enabled."""
        resolved = self.mesh_name(name)
        if resolved is None:
            return None
        if resolved in self._views:
            return self._views[resolved]
        mesh = self.world_mesh
        # Slicing a 1-D mesh by its own name is redundant (and warns on some versions).
        return mesh if mesh.mesh_dim_names == (resolved,) else mesh[resolved]

    def rank_and_size(self, name: str) -> tuple[int, int]:
        """This rank's index and the group size along a dim or view ((0, 1) when disabled)."""
        sub = self.get_mesh(name)
        return (0, 1) if sub is None else (sub.get_local_rank(), sub.size())

    def fsdp_mesh(self) -> DeviceMesh | None:
        """The mesh ``fully_shard`` takes: 1-D for FSDP, 2-D (replicate, shard) for HSDP and DDP."""
        if not (self.dp_enabled or self.fsdp_enabled):
            return None
        mesh = self.world_mesh
        if self.dp_replicate_enabled and self.fsdp_enabled:
            shard_name = self.mesh_name("dp_shard_cp")
            assert shard_name is not None, "FSDP is on, so dp_shard_cp is a view"
            with warnings.catch_warnings():
                # (dp_replicate, dp_shard_cp) mixes a dim and a flattened view; torch 2.11-2.13 only
                # offer slicing for that (it warns about a future deprecation).
                warnings.simplefilter("ignore", UserWarning)
                return mesh["dp_replicate", shard_name]
        if self.dp_replicate_enabled:
            return self._world_mesh_with_one_rank_dp_shard()["dp_replicate", "dp_shard"]
        return self.get_mesh("dp_shard_cp")

    def one_rank_fsdp_mesh(self) -> DeviceMesh:
        """A one-rank ``dp_shard`` mesh for layouts without data parallelism (TP, PP, one device).

        Nothing is sharded on it, but FSDP2 on it applies the mixed-precision policy (bf16
        compute over float32 weights), which is FSDP's job in every other layout. It comes
        from the same root as ``tp_mesh(fsdp_on_one_rank=True)``, as FSDP2 needs for TP parameters.
        """
        root = self._world_mesh_with_one_rank_dp_shard()
        return root if root.mesh_dim_names == ("dp_shard",) else root["dp_shard"]

    def tp_mesh(self, fsdp_on_one_rank: bool = False) -> DeviceMesh | None:
        """The ``tp`` mesh that ``parallelize_module`` takes.

        FSDP2 composes with TP only when both meshes come from the same root mesh, so
        under DDP (whose FSDP mesh lives on a second root, see ``_world_mesh_with_one_rank_dp_shard``), or when
        ``fsdp_on_one_rank`` says FSDP will go on ``one_rank_fsdp_mesh``, TP takes its ``tp`` dim from
        that root too.
        """
        if not self.tp_enabled:
            return None
        if fsdp_on_one_rank or (self.dp_replicate_enabled and not self.fsdp_enabled):
            return self._world_mesh_with_one_rank_dp_shard()["tp"]
        return self.world_mesh["tp"]

    def _world_mesh_with_one_rank_dp_shard(self) -> DeviceMesh:
        """A copy of the world mesh with a unit ``dp_shard`` dim in its mesh-order place.

        FSDP2 on (dp_replicate, dp_shard=1) keeps whole parameters and all-reduces
        gradients: DDP. FSDP2 on (dp_shard=1) alone only applies mixed precision. The
        world mesh has no size-1 dims, so this builds a second mesh over the same ranks.
        Every rank builds it with the same global layout, so the process groups line up.
        Built once: each construction creates groups.
        """
        mesh = self.world_mesh
        assert mesh.mesh_dim_names is not None, "build_mesh names every dim"
        names = list(mesh.mesh_dim_names)
        if "dp_shard" in names:  # one device: the world mesh is already (dp_shard=1)
            return mesh
        if self._unit_root is None:
            at = sum(MESH_DIM_NAMES.index(n) < MESH_DIM_NAMES.index("dp_shard") for n in names)
            names.insert(at, "dp_shard")
            self._unit_root = DeviceMesh(mesh.device_type, mesh.mesh.unsqueeze(at), mesh_dim_names=tuple(names))
        return self._unit_root

    # ---- what is enabled --------------------------------------------------
    @property
    def dp_enabled(self) -> bool:
        return self.dp_replicate > 1 or self.dp_shard > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP shards parameters over dp_shard x cp (CP ranks hold different tokens, same weights)."""
        return self.dp_shard > 1 or self.cp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def loss_parallel_enabled(self) -> bool:
        # Set from the config by ``from_config``; without TP there is nothing to parallelize.
        return self.tp_enabled and self._loss_parallel

    @property
    def non_data_parallel_size(self) -> int:
        return self.cp * self.tp * self.pp

    @classmethod
    def from_config(cls, parallelism, world_size: int) -> ParallelDims:
        dims = cls(
            dp_replicate=parallelism.data_parallel_replicate_degree,
            dp_shard=parallelism.data_parallel_shard_degree,
            cp=parallelism.context_parallel_degree,
            tp=parallelism.tensor_parallel_degree,
            pp=parallelism.pipeline_parallel_degree,
            world_size=world_size,
        )
        dims._loss_parallel = not parallelism.disable_loss_parallel
        return dims
