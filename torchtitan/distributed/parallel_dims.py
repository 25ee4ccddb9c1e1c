"""Parallelism degrees, their validation, and the meshes every rank is placed on.

Ranks are numbered in row-major order over the world axes ``pp, dp_replicate, dp_shard, cp, tp``
(outermost first, so that TP, the most communication-hungry, gets neighbouring ranks: one node's
fast links). Every axis is kept at degree 1 too, so each rank has a coordinate on each, and code
never asks whether an axis exists. ``ep`` is a sixth degree: expert parallelism borrows its ranks
from ``dp_shard x cp``, and from ``tp`` too when those are too few (``ep_borrows_tp``).

The meshes are unflattenings of one 1-D world mesh (``ROOT_MESHES``), so they all share one root,
as FSDP2 needs to compose with TP and HSDP:

- ``world``  (pp, dp_replicate, dp_shard, cp, tp): the layout itself; each rank's coordinates
  (seeding), and the views flattened from it (``FLATTENED_VIEWS``): ``dp`` (alias ``batch``, the
  ranks that read different data) and ``dp_cp`` (alias ``loss``, the ranks the loss is averaged over);
- ``dense``  (pp, dp_replicate, fsdp, tp): the dense parameters; FSDP shards over
  ``fsdp`` = dp_shard x cp (CP ranks hold different tokens, same weights), TP over ``tp``;
- ``sparse`` (pp, dp_replicate, efsdp, ep, etp): the experts' parameters. When ep divides
  dp_shard x cp, ``ep`` takes the inner ranks of dp_shard x cp, ``efsdp`` = dp_shard x cp / ep the
  rest, and ``etp`` = tp: every TP rank runs the MoE layer on the same tokens. Otherwise EP borrows
  TP's ranks: ep must be a multiple of tp that divides dp_shard x cp x tp; ``ep`` then takes all of
  ``tp`` and the inner ep / tp ranks of dp_shard x cp, ``efsdp`` = dp_shard x cp x tp / ep, and
  ``etp`` = 1: each TP rank routes its own sequence shard, and the experts have no TP of their own.

A degree-1 axis runs on the fake backend (no communicator is made for it), except the FSDP axes:
FSDP goes on a one-rank ``fsdp`` too, to apply mixed precision. At ep = 1 the sparse mesh is all
fake: nothing is placed on it. ``get_mesh(name)`` gives the 1-D mesh of an axis or view, and None
when its degree is 1, so no collective ever runs over a fake group.

To add an axis: its row in ``AXIS_TABLE`` (the option, the root mesh that serves it, whether it is a
world dim), its degree (a field, or a case of ``degree`` for a derived one), and its place in a mesh of
``ROOT_MESHES`` (a new mesh over the same world is one more entry there). ``enabled(name)`` and the
``*_enabled`` properties all read ``degree``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchtitan.compat import flatten_mesh, unflatten_mesh


@dataclass(frozen=True)
class Axis:
    """One axis of the layout: its name, the option that sets its degree (None: derived from the others),
    the root mesh whose dim a 1-D mesh of that name is, and whether it is a dim of the world mesh."""

    name: str
    option: str | None
    served_by: str
    world: bool = False


# The one table of axes, in mesh order; every other table below is derived from it. To add an axis: its row
# here, its degree (a ``ParallelDims`` field for a configured one, a case of ``degree`` for a derived one)
# and its place in a mesh of ``ROOT_MESHES``.
AXIS_TABLE = (
    Axis("pp", "--parallelism.pipeline_parallel_degree", "world", world=True),
    Axis("dp_replicate", "--parallelism.data_parallel_replicate_degree", "world", world=True),
    Axis("dp_shard", "--parallelism.data_parallel_shard_degree", "world", world=True),
    Axis("cp", "--parallelism.context_parallel_degree", "world", world=True),
    Axis("tp", "--parallelism.tensor_parallel_degree", "dense", world=True),
    # ep is carved from dp_shard x cp (x tp); fsdp and efsdp are derived: dp_shard x cp, and the rest of
    # ep's ranks; etp, the TP ranks a MoE layer is replicated over: tp, or 1 when ep borrows them.
    Axis("ep", "--parallelism.expert_parallel_degree", "sparse"),
    Axis("fsdp", None, "dense"),
    Axis("efsdp", None, "sparse"),
    Axis("etp", None, "sparse"),
)
# The degrees that define a layout, in mesh order (ep last: it is carved from dp_shard x cp).
WORLD_AXES = tuple(a.name for a in AXIS_TABLE if a.world)
AXES = tuple(a.name for a in AXIS_TABLE if a.option is not None)
MESH_DIM_NAMES = WORLD_AXES  # the world mesh's dims (the name callers have used)

# Each root mesh: its axes, outermost first; their degrees multiply to the world size.
ROOT_MESHES: dict[str, tuple[str, ...]] = {
    "world": WORLD_AXES,
    "dense": ("pp", "dp_replicate", "fsdp", "tp"),
    "sparse": ("pp", "dp_replicate", "efsdp", "ep", "etp"),
}
# The root mesh whose axis a 1-D name resolves to (the other meshes' copies only place their axes).
_SERVED_BY = {a.name: a.served_by for a in AXIS_TABLE}
# Views spanning several world axes (in mesh order); one with a single enabled axis is that axis.
FLATTENED_VIEWS = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}
# Names by role: the data loading's mesh, the loss's, and the FSDP axis by the world axes it spans.
ALIASES = {"batch": "dp", "loss": "dp_cp", "dp_shard_cp": "fsdp"}
_FSDP_AXES = ("fsdp", "efsdp")  # FSDP goes on them at one rank too (mixed precision): never fake
_NO_COLLECTIVE = ("etp",)  # a placement only: no collective runs over it, so it is always fake
_ROUTING_VIEW = "dp_cp_tp"  # built only when ep borrows TP's ranks (ParallelDims.routing_mesh)
# The option that sets each degree.
_OPTIONS = {a.name: a.option for a in AXIS_TABLE if a.option is not None}


def dp_shard_problem(dp_shard: int) -> str | None:
    """What is wrong with a dp_shard degree on its own (before the world size is known), or None."""
    if dp_shard == 0 or dp_shard < -1:
        return "use -1 (the ranks left over) or a degree >= 1"
    return None


def same_layout(a: Mapping[str, int] | None, b: Mapping[str, int] | None) -> bool:
    """Whether two ``ParallelDims.layout()`` records are one layout; an axis one lacks counts as degree 1
    (a record written before that axis existed)."""
    if a is None or b is None:
        return a is b
    return all(a.get(k, 1) == b.get(k, 1) for k in {*a, *b})


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    world_size: int
    ep: int = 1
    loss_parallel: bool = True  # --parallelism.disable_loss_parallel off (only matters with TP)
    _roots: dict[str, DeviceMesh] = field(default_factory=dict, init=False, repr=False)
    _meshes: dict[str, DeviceMesh] = field(default_factory=dict, init=False, repr=False)
    _fsdp_mesh: DeviceMesh | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self._validate()

    # ---- validation: every message names the option that sets the degree -----
    def _validate(self) -> None:
        for name, value in [*((a, getattr(self, a)) for a in AXES), ("world_size", self.world_size)]:
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{_OPTIONS.get(name, name)}={value!r}: must be an int")
        if self.world_size < 1:
            raise ValueError(f"ParallelDims: world_size={self.world_size} must be >= 1")
        for name in AXES:
            value = getattr(self, name)
            problem = dp_shard_problem(value) if name == "dp_shard" else (None if value >= 1 else "use a degree >= 1")
            if problem:
                raise ValueError(f"{_OPTIONS[name]}={value}: {problem}")
        if self.dp_shard == -1:
            self._check_divides()
            self.dp_shard = self.world_size // self._others()
        self._check_product()
        self._check_ep()

    def _check_ep(self) -> None:
        """ep divides dp_shard x cp, or it borrows all of TP: a multiple of tp dividing dp_shard x cp x tp."""
        data, ep, tp, opt = self.dp_shard * self.cp, self.ep, self.tp, _OPTIONS["ep"]
        if data % ep == 0:
            return
        if tp == 1 or (data * tp) % ep:
            raise ValueError(f"{opt}={ep} must divide dp_shard x cp x tp = {self.dp_shard} x {self.cp} x {tp} = "
                             f"{data * tp}: expert parallelism borrows its ranks from them; pick a degree that divides "
                             f"{data * tp}, or change the others")
        if ep % tp:
            raise ValueError(f"{opt}={ep} needs the ranks of --parallelism.tensor_parallel_degree={tp} (dp_shard x cp "
                             f"= {data} alone cannot hold it) but does not cover all of them; use a degree that "
                             f"divides {data} or a multiple of {tp} that divides {data * tp}")

    def _others(self) -> int:
        return self.dp_replicate * self.cp * self.tp * self.pp

    def _set(self, names: tuple[str, ...]) -> str:
        """The options among ``names`` that are not 1, as typed: ``--opt=N x --opt=M``."""
        return " x ".join(f"{_OPTIONS[n]}={getattr(self, n)}" for n in names if getattr(self, n) != 1)

    def _check_divides(self) -> None:
        others, ws = self._others(), self.world_size
        if ws % others == 0:
            return
        typed = ("pp", "dp_replicate", "cp", "tp")
        culprits = [n for n in typed if getattr(self, n) != 1]
        if len(culprits) == 1:
            room = ws // (others // getattr(self, culprits[0]))  # what the other degrees leave it
            fits = [str(d) for d in range(1, room + 1) if room % d == 0]
            fix, product = f"set {_OPTIONS[culprits[0]]} to {' or '.join(fits)}", ""
        else:
            fix, product = "change them so their product divides it", f" = {others}"
        raise ValueError(f"{self._set(typed)}{product} does not divide the number of ranks (world_size={ws}); "
                         f"--parallelism.data_parallel_shard_degree=-1 gives dp_shard the ranks left over, so the "
                         f"other degrees must divide {ws}: {fix}, or launch a multiple of {others} processes")

    def _check_product(self) -> None:
        product = self._others() * self.dp_shard
        if product == self.world_size:
            return
        typed = " x ".join(f"{_OPTIONS[n]}={getattr(self, n)}" for n in WORLD_AXES
                           if getattr(self, n) != 1 or n == "dp_shard")
        raise ValueError(f"{typed} = {product}, but world_size={self.world_size} (the processes launched); make the "
                         "product equal the number of processes, or set --parallelism.data_parallel_shard_degree=-1 "
                         "to give dp_shard the ranks left over")

    # ---- the layout ---------------------------------------------------------
    def degree(self, name: str) -> int:
        """Size of an axis, a view or an alias (1 when it is disabled)."""
        name = ALIASES.get(name, name)
        if name == "fsdp":
            return self.dp_shard * self.cp
        if name == "efsdp":
            return self.dp_shard * self.cp * self.tp // (self.ep * self.degree("etp"))
        if name == "etp":
            return 1 if self.ep_borrows_tp else self.tp
        return math.prod(getattr(self, d) for d in FLATTENED_VIEWS.get(name, (name,)))

    def axes(self) -> list[tuple[str, int]]:
        """Every degree of the layout with its axis name, in mesh order (``ep`` last)."""
        return [(name, getattr(self, name)) for name in AXES]

    def layout(self) -> dict[str, int]:
        """The layout as a record (a checkpoint keeps it): the world size and every degree."""
        return {"world_size": self.world_size, **dict(self.axes())}

    @property
    def enabled_dims(self) -> list[str]:
        """World axes with degree > 1, in mesh order."""
        return [d for d in WORLD_AXES if getattr(self, d) > 1]

    def rank_at(self, **coords: int) -> int:
        """The global rank at these world-axis coordinates (0 on every axis not given)."""
        unknown = [k for k in coords if k not in WORLD_AXES]
        if unknown:
            raise ValueError(f"ParallelDims.rank_at: unknown axis {', '.join(unknown)}; choose from "
                             f"{', '.join(WORLD_AXES)}")
        rank = 0
        for name in WORLD_AXES:
            rank = rank * getattr(self, name) + coords.get(name, 0)
        return rank

    def label(self, name: str) -> str:
        """The name a 1-D mesh goes by in the layout: a view over one enabled world axis is that axis,
        so FSDP (``fsdp``, the view dp_shard x cp) over dp_shard alone is ``dp_shard``."""
        name = ALIASES.get(name, name)
        view = "dp_shard_cp" if name == "fsdp" else name
        parts = [d for d in FLATTENED_VIEWS.get(view, (view,)) if self.degree(d) > 1]
        return parts[0] if len(parts) == 1 else view

    # ---- building the meshes -------------------------------------------------
    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Build every root mesh and view (a collective: call on every rank); returns the world mesh."""
        world = init_device_mesh(device_type, (self.world_size,), mesh_dim_names=("world",))
        self._roots = {name: self._unflatten(world, name, axes) for name, axes in ROOT_MESHES.items()}
        self._meshes = {name: self._roots[root][name] for name, root in _SERVED_BY.items()
                        if self.degree(name) > 1 and self._in_use(root) and name not in _NO_COLLECTIVE}
        for view, dims in FLATTENED_VIEWS.items():
            enabled = tuple(d for d in dims if self.degree(d) > 1)
            if view in ALIASES or not enabled:
                continue
            # One enabled axis is already its own view; flattening it again would only add groups.
            one = len(enabled) == 1
            self._meshes[view] = self._meshes[enabled[0]] if one else flatten_mesh(self._roots["world"][enabled], view)
        if self.ep_borrows_tp:
            # The ranks whose MoE layers route different tokens, when TP ranks are among them (routing_mesh).
            enabled = tuple(d for d in (*FLATTENED_VIEWS["dp_cp"], "tp") if self.degree(d) > 1)
            self._meshes[_ROUTING_VIEW] = flatten_mesh(self._roots["world"][enabled], _ROUTING_VIEW)
        dense = self._roots["dense"]
        self._fsdp_mesh = dense["dp_replicate", "fsdp"] if self.dp_replicate > 1 else dense["fsdp"]
        return self._roots["world"]

    def _in_use(self, root: str) -> bool:
        """Whether anything is placed on a root mesh: the sparse one only with expert parallelism."""
        return root != "sparse" or self.ep > 1

    def _unflatten(self, world: DeviceMesh, name: str, axes: tuple[str, ...]) -> DeviceMesh:
        sizes = tuple(self.degree(a) for a in axes)
        in_use = self._in_use(name)
        fake = tuple(a for a, size in zip(axes, sizes)
                     if not in_use or a in _NO_COLLECTIVE or (size == 1 and a not in _FSDP_AXES))
        return unflatten_mesh(world, sizes, axes, fake=fake)

    @property
    def world_mesh(self) -> DeviceMesh:
        return self.root_mesh("world")

    def root_mesh(self, name: str) -> DeviceMesh:
        """A root mesh of ``ROOT_MESHES``: ``world``, ``dense`` or ``sparse``."""
        if not self._roots:
            raise RuntimeError("ParallelDims.build_mesh() has not been called yet")
        return self._roots[name]

    def get_mesh(self, name: str) -> DeviceMesh | None:
        """The 1-D mesh of an axis, view or alias; None when its degree is 1."""
        self.root_mesh("world")
        name = ALIASES.get(name, name)
        if name not in self._meshes and name not in _SERVED_BY and name not in FLATTENED_VIEWS:
            raise KeyError(f"ParallelDims: no mesh named {name!r}; choose from {', '.join(self.mesh_names())}")
        return self._meshes.get(name)

    def mesh_names(self) -> list[str]:
        """Every name ``get_mesh`` answers (axes, views and aliases)."""
        return list(dict.fromkeys([*_SERVED_BY, *FLATTENED_VIEWS, *ALIASES]))

    def rank_and_size(self, name: str) -> tuple[int, int]:
        """This rank's index and the group size along an axis or view ((0, 1) when disabled)."""
        sub = self.get_mesh(name)
        return (0, 1) if sub is None else (sub.get_local_rank(), sub.size())

    def group_labels(self) -> dict[str, str]:
        """Process-group name -> the layout name (``label``) of every real group the meshes made."""
        labels: dict[str, str] = {}
        for name in self.mesh_names():
            mesh = self.get_mesh(name)
            if mesh is not None:
                labels.setdefault(mesh.get_group().group_name, self.label(name))
        if _ROUTING_VIEW in self._meshes:
            labels.setdefault(self._meshes[_ROUTING_VIEW].get_group().group_name, _ROUTING_VIEW)
        for root, axes in ROOT_MESHES.items():
            for axis in axes:
                if self.degree(axis) > 1 and self._in_use(root) and axis not in _NO_COLLECTIVE:
                    labels.setdefault(self._roots[root].get_group(axis).group_name, self.label(axis))
        return labels

    # ---- what FSDP and TP take -------------------------------------------------
    def fsdp_mesh(self) -> DeviceMesh | None:
        """The mesh ``fully_shard`` takes: ``fsdp`` for FSDP, (dp_replicate, fsdp) for HSDP and DDP."""
        if not (self.dp_enabled or self.fsdp_enabled):
            return None
        self.root_mesh("dense")
        return self._fsdp_mesh

    def expert_fsdp_mesh(self) -> DeviceMesh:
        """The mesh ``fully_shard`` takes for expert-parallel experts: ``efsdp`` (dp_shard x cp / ep ranks that
        hold the same experts), with ``dp_replicate`` outside it under HSDP. Only with expert parallelism."""
        if not self.ep_enabled:
            raise RuntimeError("ParallelDims.expert_fsdp_mesh: expert parallelism is off (ep=1)")
        sparse = self.root_mesh("sparse")
        return sparse["dp_replicate", "efsdp"] if self.dp_replicate > 1 else sparse["efsdp"]

    def one_rank_fsdp_mesh(self) -> DeviceMesh:
        """The ``fsdp`` axis, one rank in layouts without data parallelism (TP, PP, one device).

        Nothing is sharded on it, but FSDP2 on it applies the mixed-precision policy (bf16
        compute over float32 weights), which is FSDP's job in every other layout.
        """
        return self.root_mesh("dense")["fsdp"]

    def routing_mesh(self) -> DeviceMesh | None:
        """The ranks whose MoE layers route different tokens, over which token counts are summed: ``dp x cp``
        (``loss``; TP ranks route the same tokens), and ``tp`` too when expert parallelism borrows TP's ranks.
        None on one rank."""
        if self.ep_borrows_tp:
            self.root_mesh("world")
            return self._meshes[_ROUTING_VIEW]
        return self.get_mesh("loss")

    def tp_mesh(self) -> DeviceMesh | None:
        """The ``tp`` mesh that ``parallelize_module`` takes (None without TP).

        It comes from the dense mesh, as every FSDP mesh does, so FSDP2 composes with it in every layout.
        """
        return self.get_mesh("tp")

    # ---- what is enabled: degree > 1, one rule for every axis and view ------------
    def enabled(self, name: str) -> bool:
        """Whether an axis, view or alias has more than one rank (``fsdp``: dp_shard x cp; ``dp``: both dp axes)."""
        return self.degree(name) > 1

    dp_enabled = property(lambda self: self.enabled("dp"))
    dp_replicate_enabled = property(lambda self: self.enabled("dp_replicate"))
    dp_shard_enabled = property(lambda self: self.enabled("dp_shard"))
    fsdp_enabled = property(lambda self: self.enabled("fsdp"))  # CP ranks hold different tokens, same weights
    cp_enabled = property(lambda self: self.enabled("cp"))
    tp_enabled = property(lambda self: self.enabled("tp"))
    pp_enabled = property(lambda self: self.enabled("pp"))
    ep_enabled = property(lambda self: self.enabled("ep"))

    @property
    def ep_borrows_tp(self) -> bool:
        """Whether expert parallelism takes TP's ranks (dp_shard x cp alone cannot hold ep): each TP rank then
        routes its own tokens through the MoE layers, where otherwise they all route the same ones."""
        return self.ep > 1 and self.tp > 1 and (self.dp_shard * self.cp) % self.ep != 0

    @property
    def loss_parallel_enabled(self) -> bool:
        return self.tp_enabled and self.loss_parallel  # without TP there is nothing to parallelize

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
            ep=parallelism.expert_parallel_degree,
            loss_parallel=not parallelism.disable_loss_parallel,
        )
        return dims
