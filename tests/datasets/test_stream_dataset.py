"""Hub streaming mode, on a local file streamed the way the hub is (no network here).

Each DP rank reads its own documents; the held-out split keeps either side; ``rewind``
starts a validation pass again; a checkpoint resumes exactly, and only at its DP degree.
"""

from __future__ import annotations

import json

import pytest
import torch

from torchtitan.datasets import DataLayout, HeldOutSplit, build_tokenizer
from torchtitan.datasets.sources import load_local_dataset
from torchtitan.datasets.stream_dataset import ShardedStreamDataset

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
SEQ, BATCH = 16, 2


@pytest.fixture(scope="module")
def setup(tmp_path_factory, shipped_tokenizer):
    documents = [f"streamed document {i}: " + "tokens of text " * (3 + i % 5) for i in range(120)]
    path = tmp_path_factory.mktemp("stream") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents), encoding="utf-8")
    return str(path), documents, build_tokenizer(shipped_tokenizer)


def _stream(setup, rank: int, degree: int, **kw) -> ShardedStreamDataset:
    path, _, tokenizer = setup
    return ShardedStreamDataset(source=load_local_dataset(path), text_field="text", tokenizer=tokenizer,
                                layout=DataLayout(SEQ, BATCH, rank, degree), **kw)


def _tokens(batches) -> list[int]:
    """The token stream the batches were cut from (each window's inputs plus its last label)."""
    return [t for inputs, labels in batches for x, y in zip(inputs, labels) for t in x.tolist() + y[-1:].tolist()]


def _expected(tokenizer, documents: list[str]) -> list[int]:
    return [t for d in documents for t in tokenizer.encode(d, bos=True, eos=True)]


def test_each_rank_packs_its_own_documents_and_a_split_keeps_either_side(setup):
    _, documents, tokenizer = setup
    # One file: split_dataset_by_node deals the records round-robin.
    for rank in (0, 1):
        got = _tokens(list(_stream(setup, rank, 2, infinite=False)))
        want = _expected(tokenizer, documents[rank::2])
        assert len(want) - len(got) < BATCH * (SEQ + 1) and got == want[: len(got)]
    split = HeldOutSplit(0.3, seed=5)
    for held_out in (False, True):
        kept = [d for d in documents if split.held_out(d) == held_out]
        got = _tokens(list(_stream(setup, 0, 1, infinite=False, split=split, held_out=held_out)))
        assert 0 < len(got) and got == _expected(tokenizer, kept)[: len(got)]


def test_rewind_and_resume(setup):
    data = _stream(setup, 1, 2)  # endless, as validation streams it
    it = iter(data)
    first = next(it)
    state = data.state_dict()
    second = next(it)
    assert not torch.equal(first[0], second[0])
    data.rewind()
    again = next(iter(data))
    assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
    resumed = _stream(setup, 1, 2)
    resumed.load_state_dict(state)
    assert torch.equal(next(iter(resumed))[0], second[0])
    with pytest.raises(ValueError, match="the data order depends on the DP degree"):
        _stream(setup, 1, 4).load_state_dict(state)
