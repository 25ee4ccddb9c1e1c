"""Creating this group's torchft manager, after clearing what a dead one left in torchrun's store.

torchrun keeps its TCPStore across ``--max-restarts`` rounds. The manager publishes its
address there under fixed keys; a restarted rank that read a dead manager's address would
join nobody's quorum and train alone. So rank 0 deletes those keys first, and every rank
waits for that before creating its manager.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from torchtitan.compat import TCPStore
from torchtitan.config.job_config import FaultTolerance
from torchtitan.fault_tolerance.checks import lighthouse_address
from torchtitan.fault_tolerance.manager_protocol import FTManager
from torchtitan.fault_tolerance.state import HealState

logger = logging.getLogger(__name__)


def _store_address() -> tuple[str, int]:
    """The store the manager uses: torchrun's (or train.py's own), at MASTER_ADDR:MASTER_PORT."""
    return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])


def clear_stale_manager_keys(timeout_seconds: float = 60.0) -> list[str]:
    """Delete the manager keys a previous round left in the store; return the keys that were there."""
    from torchft.manager import MANAGER_ADDR_KEY, REPLICA_ID_KEY

    host, port = _store_address()
    store = TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout_seconds))
    return [key for key in (MANAGER_ADDR_KEY, REPLICA_ID_KEY) if store.delete_key(key)]


def replica_name(replica_id: int) -> str:
    """The id this group reports to the lighthouse; torchft reads its trailing digits as the group index."""
    return f"replica_group_{replica_id}"


def build_manager(ft: FaultTolerance, state: HealState, device: torch.device) -> FTManager:
    """This group's torchft Manager: its quorum, commit vote, heal transfer and cross-group process group."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at info level
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    from torchtitan.fault_tolerance.log_filters import quiet_torchft
    from torchtitan.fault_tolerance.startup import StartupManager, StartupWait

    # torchft's Python side logs every quorum and commit too (some as empty lines); keep its warnings.
    for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
        logging.getLogger(name).setLevel(logging.WARNING)
    quiet_torchft()
    timeout = timedelta(seconds=ft.timeout_seconds)
    if dist.get_rank() == 0:
        stale = clear_stale_manager_keys()
        if stale:
            logger.info("Fault tolerance: deleted the keys %s a previous manager left in the store", stale)
    dist.barrier()  # nobody reads the manager's address before the stale one is gone
    pg = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
    host, port = _store_address()
    startup = StartupWait(ft.num_replica_groups, ft.startup_timeout_seconds, lambda flag: _any_rank(flag, device))
    manager = StartupManager(
        startup=startup, pg=pg, load_state_dict=state.load_state_dict, state_dict=state.state_dict,
        min_replica_size=ft.min_replicas, timeout=timeout,
        # Every step: the quorum runs during forward. DiLoCo/LocalSGD: torchft needs it synchronous, at the sync.
        use_async_quorum=ft.semi_sync_method == "none",
        quorum_timeout=timedelta(seconds=ft.quorum_timeout_seconds),
        connect_timeout=timedelta(seconds=ft.connect_timeout_seconds),
        rank=dist.get_rank(), world_size=dist.get_world_size(), store_addr=host, store_port=port,
        lighthouse_addr=lighthouse_address(ft), replica_id=replica_name(ft.replica_id),
        # Every group starts from the same seeded (or loaded) weights: no sync at step 0.
        init_sync=False, quorum_retries=ft.quorum_retries,
    )
    logger.info("Fault tolerance: replica group %d of at most %d, lighthouse %s, min_replicas %d, startup timeout "
                "%d s", ft.replica_id, ft.num_replica_groups, lighthouse_address(ft), ft.min_replicas,
                ft.startup_timeout_seconds)
    return manager


def _any_rank(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` holds on any rank of this group: its ranks must all take the same branch."""
    t = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())
