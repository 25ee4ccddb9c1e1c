"""Config checks of fault-tolerant HSDP, run by preflight before any process group exists.

Each replica group is its own torchrun job, so these checks see one group's config; what
must agree between groups (the layout, the seed, num_replica_groups) is stated in
docs/fault_tolerance.md and, where a mismatch would corrupt training, caught at run time by torchft (a heal
whose shapes differ fails its copy).
"""

from __future__ import annotations

import importlib.util
import os

from torchtitan.config.job_config import Checkpoint, Comm, FaultTolerance, Optimizer, Training
from torchtitan.distributed import ParallelDims

FT = "--fault_tolerance."
INSTALL = "pip install torchft==0.2.0 (scripts/install.sh installs it)"


def lighthouse_address(ft: FaultTolerance) -> str | None:
    """The lighthouse this group reports to: the config's, else ``$TORCHFT_LIGHTHOUSE``."""
    return ft.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE") or None


def check_fault_tolerance(ft: FaultTolerance, dims: ParallelDims, *, comm: Comm, training: Training,
                          checkpoint: Checkpoint, optimizer: Optimizer) -> list[str]:
    """One line per problem of the ``[fault_tolerance]`` section ``ft``, against the layout and the other sections
    it constrains (the timeouts, the seed, the data, the checkpoint's start, the optimizer); none when it is
    disabled."""
    if not ft.enable:
        return []
    problems: list[str] = []
    if importlib.util.find_spec("torchft") is None:
        problems.append(f"{FT}enable needs torchft, which is not installed: {INSTALL}")
    if not 0 <= ft.replica_id < ft.num_replica_groups:
        problems.append(f"{FT}replica_id={ft.replica_id} is out of range: give 0 <= replica_id < "
                        f"num_replica_groups ({ft.num_replica_groups}), one id per group")
    if ft.min_replicas > ft.num_replica_groups:
        problems.append(f"{FT}min_replicas={ft.min_replicas} exceeds num_replica_groups={ft.num_replica_groups}: "
                        "no step could ever commit")
    if lighthouse_address(ft) is None:
        problems.append(f"{FT}enable needs a lighthouse: set {FT}lighthouse=http://HOST:PORT or $TORCHFT_LIGHTHOUSE, "
                        "and start one with `torchft_lighthouse --min_replicas 1` (docs/fault_tolerance.md)")
    if dims.dp_replicate != 1:
        problems.append(f"{FT}enable needs --parallelism.data_parallel_replicate_degree=1 (got {dims.dp_replicate}): "
                        "the replica groups are separate torchrun jobs; set num_replica_groups instead")
    if dims.pp_enabled:
        problems.append(f"{FT}enable does not support pipeline parallelism inside a group yet: "
                        "set --parallelism.pipeline_parallel_degree=1")
    if training.seed is None and checkpoint.initial_load_path is None:
        problems.append(f"{FT}enable needs --training.seed (or --checkpoint.initial_load_path): otherwise the groups "
                        "start from different weights")
    problems += _timeout_problems(ft, comm)
    problems += _semi_sync_problems(ft)
    problems += _not_built_problems(checkpoint, training, optimizer)
    return problems


def _semi_sync_problems(ft: FaultTolerance) -> list[str]:
    """DiLoCo's schedule: each fragment synced once per ``sync_steps``, one at a time, before its next turn."""
    problems: list[str] = []
    if ft.semi_sync_method == "none":
        return []
    if ft.semi_sync_method == "local_sgd" and (ft.num_fragments != 1 or ft.fragment_sync_delay):
        problems.append(f"{FT}semi_sync_method=local_sgd averages the whole model at once: num_fragments and "
                        "fragment_sync_delay apply to diloco only (leave them at 1 and 0)")
        return problems
    if ft.sync_steps % ft.num_fragments:
        problems.append(f"{FT}sync_steps={ft.sync_steps} is not divisible by num_fragments={ft.num_fragments}: "
                        "each fragment syncs every sync_steps / num_fragments steps; give a multiple")
    elif ft.fragment_sync_delay >= ft.sync_steps // ft.num_fragments:
        problems.append(f"{FT}fragment_sync_delay={ft.fragment_sync_delay} must be below sync_steps / num_fragments "
                        f"({ft.sync_steps // ft.num_fragments}): a fragment's sync must finish before the next starts")
    if ft.fragment_update_alpha > 1:
        problems.append(f"{FT}fragment_update_alpha={ft.fragment_update_alpha} must be in [0, 1] (the weight of "
                        "the local parameters when a synced fragment is merged)")
    return problems


def _timeout_problems(ft: FaultTolerance, comm: Comm) -> list[str]:
    """torchft's timeout < the train timeout < the init timeout: the inner failure must surface first."""
    if ft.timeout_seconds < comm.train_timeout_seconds < comm.init_timeout_seconds:
        return []
    return [f"timeouts out of order: need {FT}timeout_seconds ({ft.timeout_seconds}) < "
            f"--comm.train_timeout_seconds ({comm.train_timeout_seconds}) < --comm.init_timeout_seconds "
            f"({comm.init_timeout_seconds}), so that a dead group fails torchft's all-reduce (a retried step) "
            "before it fails a group's own collectives (a crash)"]


def _not_built_problems(checkpoint: Checkpoint, training: Training, optimizer: Optimizer) -> list[str]:
    """Parts of fault tolerance this project does not have yet: refused, never silently ignored."""
    problems = []
    if checkpoint.create_seed_checkpoint:
        problems.append(f"{FT}enable with --checkpoint.create_seed_checkpoint: write the seed checkpoint with a plain "
                        "run (one process), then start the groups from it")
    t = training
    if t.dataset_path is None and t.dataset != "embedded":
        problems.append(f"{FT}enable needs a token store: --training.dataset={t.dataset} is streamed from the hub, "
                        "whose order depends on the data-parallel degree; prepare it with scripts/prepare_data.py "
                        "and pass --training.dataset_path")
    if optimizer.name == "MuonClip":
        # Muon alone works: its owners are the group's ranks, fed the gradient torchft averaged over the groups.
        problems.append(f"{FT}enable with --optimizer.name=MuonClip: QK-clip takes each head's largest logit over "
                        "this replica group's ranks only, so the groups would rescale different heads and drift "
                        "apart; use --optimizer.name=Muon under fault tolerance")
    return problems
