"""Which slot of the job's global batch a rank reads: its data-parallel rank among all readers.

Without fault tolerance that is the rank's data-parallel (rank, degree). Under fault tolerance
each replica group is its own job, and the groups' data ranks sit side by side: every group
reads its own slots of the same global window order, so a dead group's windows are skipped
(nobody reads them), never replayed by a survivor.
"""

from __future__ import annotations

from torchtitan.config.job_config import FaultTolerance, Training
from torchtitan.datasets.layout import DataLayout


def data_slot(replica_id: int, num_replica_groups: int, dp_rank: int, dp_degree: int) -> tuple[int, int]:
    """This rank's data-parallel (rank, degree) in the job: the groups' data ranks side by side."""
    return replica_id * dp_degree + dp_rank, num_replica_groups * dp_degree


def job_data_layout(training: Training, ft: FaultTolerance, dp_rank: int, dp_degree: int) -> DataLayout:
    """This rank's training data layout: the job's ``seq_len`` and local batch, read from its ``data_slot``
    (its own data-parallel rank and degree unless ``ft`` makes it one replica group)."""
    rank, degree = (data_slot(ft.replica_id, ft.num_replica_groups, dp_rank, dp_degree) if ft.enable
                    else (dp_rank, dp_degree))
    return DataLayout(training.seq_len, training.batch_size, rank, degree)
