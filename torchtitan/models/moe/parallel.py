"""Expert parallelism for one ``MoE`` module: its experts sharded over a 1-D ``ep`` mesh.

``apply_expert_parallel(moe, ep_mesh)`` turns each stacked expert weight ``[E, ...]`` into a
DTensor ``Shard(0)`` on ``ep_mesh`` (rank ``r`` keeps experts ``[r*E/ep, (r+1)*E/ep)``), made
from this rank's slice with no collective (works on a meta model), and gives the module an
``AllToAllDispatcher`` over the mesh's group. The router and the shared experts stay
replicated: their gradients must be reduced over the data ranks as any dense weight's.
Initialise after this with ``layout_init``: a ``Shard(0)`` weight draws only its rows, the
same rows a single process draws for those experts.

Gradients: an expert's gradient sums the tokens that all ``ep`` ranks sent it, where a dense
weight's gradient on a rank sums that rank's tokens only. The experts scale their gradients by
``1 / ep``, so that both are a mean over the data ranks once data parallelism has averaged them
(FSDP over the ``efsdp`` ranks for the experts, over every data rank for the dense weights), with
the trainer's loss scale unchanged and nothing asked of FSDP's reduction.

When expert parallelism borrows TP's ranks, ``split_over_tp(moe, tp_mesh)`` comes first (before the
TP plan, which then gives the layer its rank's sequence shard): each TP rank routes its own tokens, the
router's and shared experts' gradients are summed over TP (``tp_grads.py``), and the ``ep`` ranks then
hold ``ep / tp`` ranks' worth of different data (each data rank's tokens are spread over its ``tp`` ranks),
so the experts scale by ``tp / ep``.
"""

from __future__ import annotations

import logging
import os

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from torchtitan.distributed.group_labels import label_group
from torchtitan.models.moe.dispatch import AllToAllDispatcher
from torchtitan.models.moe.moe import MoE
from torchtitan.models.moe.node_dispatch import NodeDispatcher

logger = logging.getLogger(__name__)


def apply_expert_parallel(moe: MoE, ep_mesh: DeviceMesh,
                          hops: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None) -> None:
    """Shard ``moe``'s experts over the 1-D ``ep_mesh`` and dispatch tokens by all-to-all over it: in two hops over
    ``hops`` (``node_hop_groups``: inter, intra) when given."""
    if ep_mesh.ndim != 1:
        raise ValueError(f"expert parallelism needs a 1-D ep mesh; got {ep_mesh.ndim} dimensions")
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    experts = moe.experts
    if experts.num_experts % ep:
        raise ValueError(f"moe num_experts={experts.num_experts} is not divisible by the expert-parallel degree {ep}")
    per_rank = experts.num_experts // ep
    for name in experts.stacked_names:
        full = getattr(experts, name)
        if isinstance(full, DTensor):
            raise ValueError(f"experts.{name} is already a DTensor: apply expert parallelism once, before FSDP")
        # A copy: a view would keep the full tensor's storage alive on a materialised model.
        local = full.detach()[rank * per_rank : (rank + 1) * per_rank].clone()
        sharded = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
        setattr(experts, name, nn.Parameter(sharded, requires_grad=full.requires_grad))
    # The ep ranks' tokens are those of ep / tp_split data ranks (split_over_tp): the mean over those.
    experts.grad_scale = moe.tp_split / ep
    moe.dispatcher = (AllToAllDispatcher(experts.num_experts, ep_mesh.get_group()) if hops is None
                      else NodeDispatcher(experts.num_experts, *hops))


def node_hop_groups(ep_group: dist.ProcessGroup,
                    gpus_per_node: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup] | None:
    """``(inter, intra)`` for the two-hop dispatch over ``ep_group``, whose ranks sit on nodes of ``gpus_per_node``
    consecutive global ranks: ``inter`` the EP ranks of this rank's local index on every node, ``intra`` this node's
    EP ranks. None (one hop, said) when the EP ranks share one node. The groups are made with local synchronization:
    only their members create them, each in the same order."""
    ranks = dist.get_process_group_ranks(ep_group)
    node_of = [r // gpus_per_node for r in ranks]
    nodes = list(dict.fromkeys(node_of))
    per_node = len(ranks) // len(nodes)
    if any(node_of[i] != nodes[i // per_node] for i in range(len(ranks))) or per_node * len(nodes) != len(ranks):
        raise ValueError(f"--moe.dispatch_gpus_per_node={gpus_per_node}: the expert-parallel ranks {ranks} are not "
                         "spread evenly over nodes of that many consecutive ranks; set it to the GPUs per node of "
                         "this cluster, or 0 for one hop")
    if len(nodes) == 1:
        logger.info("--moe.dispatch_gpus_per_node=%d: the %d expert-parallel ranks share one node; one hop",
                    gpus_per_node, len(ranks))
        return None
    me = ranks.index(dist.get_rank())
    node, local = divmod(me, per_node)
    inter = dist.new_group([ranks[n * per_node + local] for n in range(len(nodes))], use_local_synchronization=True)
    intra = dist.new_group(ranks[node * per_node : (node + 1) * per_node], use_local_synchronization=True)
    assert isinstance(inter, dist.ProcessGroup) and isinstance(intra, dist.ProcessGroup), "a member gets its group"
    label_group(inter, "ep_inter_node")
    label_group(intra, "ep_intra_node")
    logger.info("Two-hop expert dispatch: %d expert-parallel ranks over %d nodes of %d (--moe.dispatch_gpus_per_node"
                "=%d)", len(ranks), len(nodes), per_node, gpus_per_node)
    mismatch = launcher_node_mismatch(gpus_per_node, os.environ.get("LOCAL_WORLD_SIZE"))
    if mismatch:
        logger.warning(mismatch)
    return inter, intra


def split_over_tp(moe: MoE, tp_mesh: DeviceMesh) -> None:
    """Make each TP rank route its own tokens through ``moe`` (expert parallelism borrowing TP's ranks):
    the router's and shared experts' gradients summed over ``tp_mesh``. The TP plan gives the layer its
    rank's sequence shard (``models/common/parallel.apply_tp``)."""
    if isinstance(moe.experts.w1, DTensor):
        raise ValueError("split the MoE layer over TP before applying expert parallelism")
    group: dist.ProcessGroup = tp_mesh.get_group()
    moe.tp_split = tp_mesh.size()
    moe.router.grad_group = group
    if moe.shared_experts is not None:
        moe.shared_experts.grad_group = group


def launcher_node_mismatch(gpus_per_node: int, local_world_size: str | None) -> str | None:
    """The line that says the option's nodes are not the launcher's (torchrun's ranks per node), or None: the model
    is the same either way, but the first hop then crosses no network, or the second does."""
    if local_world_size is None or int(local_world_size) == gpus_per_node:
        return None
    return (f"--moe.dispatch_gpus_per_node={gpus_per_node}, but the launcher runs {local_world_size} ranks per node: "
            "the two hops follow the option (the same model), not the machines' nodes; set it to the GPUs per node")
