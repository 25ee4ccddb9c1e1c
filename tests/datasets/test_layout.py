"""``DataLayout``: the one description of a rank's share of the data that every dataset and loader takes."""

from __future__ import annotations

import dataclasses

import pytest

from torchtitan.datasets import DataLayout


def test_a_layout_names_its_global_batch_and_this_ranks_rows():
    layout = DataLayout(seq_len=16, local_batch_size=3, dp_rank=2, dp_degree=4)
    assert layout.global_batch_size == 12
    assert layout.first_row == 6  # ranks 0 and 1 read rows 0..5 of each global batch
    assert DataLayout(16, 3) == DataLayout(16, 3, 0, 1)  # one reader by default
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.dp_rank = 0  # type: ignore[misc]  # built once, passed down unchanged


@pytest.mark.parametrize(("values", "message"), [
    ((0, 2, 0, 1), "seq_len must be positive, got 0"),
    ((16, 0, 0, 1), "local_batch_size must be positive, got 0"),
    ((16, 2, 0, 0), "dp_degree must be positive, got 0"),
    ((16, 2, 2, 2), r"dp_rank must be in \[0, 2\), got 2"),
    ((16, 2, -1, 2), r"dp_rank must be in \[0, 2\), got -1"),
])
def test_a_layout_that_cannot_work_is_refused_on_construction(values, message):
    with pytest.raises(ValueError, match=message):
        DataLayout(*values)
