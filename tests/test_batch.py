"""``Batch``: a loader's tuples by name, every tensor field mapped, the model's keyword inputs."""

from __future__ import annotations

import pytest
import torch

from torchtitan.batch import Batch


def test_a_loaders_tuples_become_named_batches():
    inputs, labels, positions = torch.arange(6).view(2, 3), torch.arange(6).view(2, 3) + 1, torch.zeros(2, 3)
    plain = Batch.of((inputs, labels))
    assert plain.inputs is inputs and plain.labels is labels and plain.positions is None
    assert plain.model_kwargs() == {}
    masked = Batch.of([inputs, labels, positions])
    assert masked.positions is positions and masked.model_kwargs() == {"positions": positions}
    assert Batch.of(masked) is masked
    with pytest.raises(ValueError, match=r"\(inputs, labels\) or \(inputs, labels, positions\), got 1"):
        Batch.of((inputs,))


def test_map_applies_to_every_tensor_field_and_leaves_unset_ones():
    batch = Batch(torch.ones(2, 4), torch.full((2, 4), 2.0), torch.arange(8).view(2, 4))
    halves = batch.map(lambda t: t[:, :2])
    assert [tuple(t.shape) for t in (halves.inputs, halves.labels, halves.positions)] == [(2, 2)] * 3
    assert torch.equal(halves.positions, torch.tensor([[0, 1], [4, 5]]))
    assert Batch(torch.ones(1), torch.ones(1)).map(lambda t: t * 3).positions is None
