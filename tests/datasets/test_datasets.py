"""Tests for the data pipeline: embedded corpus, tokenizer, packing and DP layout."""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from torchtitan.datasets import (
    DATASETS,
    DataLayout,
    HeldOutSplit,
    Tokenizer,
    build_dataloader,
    build_tokenizer,
    embedded_corpus,
    ensure_embedded_corpus,
)

# torchdata calls a torch API that recent torch versions deprecate; not ours.
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")

SEQ_LEN = 32


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def corpus_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Build the embedded corpus once, in a private cache that "embedded" also uses."""
    cache = tmp_path_factory.mktemp("torchtitan_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCHTITAN_CACHE", str(cache))
        yield ensure_embedded_corpus()


@pytest.fixture(scope="session")
def tokenizer(shipped_tokenizer) -> Tokenizer:
    return build_tokenizer(shipped_tokenizer)


def make_loader(tokenizer: Tokenizer, *, batch: int, rank: int = 0, degree: int = 1, seq_len: int = SEQ_LEN, **kwargs):
    # Unshuffled: these tests check the packing against the plain stream; the shuffled order is tested in
    # test_token_store.py.
    options = dict(dataset_name="embedded", dataset_path=None, infinite=True, shuffle=False)
    options.update(kwargs)
    return build_dataloader(tokenizer=tokenizer, layout=DataLayout(seq_len, batch, rank, degree), **options)


def take(loader, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    iterator = iter(loader)
    return [next(iterator) for _ in range(steps)]


def global_batches(tokenizer: Tokenizer, *, batch: int, degree: int, steps: int, **kwargs) -> list[torch.Tensor]:
    """Inputs of every rank concatenated in rank order, one tensor per step."""
    per_rank = [
        take(make_loader(tokenizer, batch=batch, rank=rank, degree=degree, **kwargs), steps)
        for rank in range(degree)
    ]
    return [torch.cat([per_rank[rank][step][0] for rank in range(degree)]) for step in range(steps)]


def packed_windows(tokenizer: Tokenizer, documents: list[str], seq_len: int = SEQ_LEN) -> list[list[int]]:
    """Reference packing, written as plainly as possible."""
    stream: list[int] = []
    for doc in documents:
        stream += tokenizer.encode(doc, bos=True, eos=True)
    window = seq_len + 1
    return [stream[i * window : (i + 1) * window] for i in range(len(stream) // window)]


def read_corpus(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


# ------------------------------------------------------------ embedded corpus


def test_corpus_is_deterministic_and_well_formed(corpus_path: str, tmp_path: Path) -> None:
    rebuilt = ensure_embedded_corpus(str(tmp_path))
    assert Path(rebuilt).read_bytes() == Path(corpus_path).read_bytes()

    name = Path(corpus_path).name
    assert f"py{sys.version_info.major}{sys.version_info.minor}" in name
    assert embedded_corpus.CORPUS_VERSION in name

    documents = read_corpus(corpus_path)
    assert len(documents) > 500
    assert sum(map(len, documents)) > 1_000_000  # about 1.4 MB on CPython 3.11
    assert all(len(doc) >= embedded_corpus.MIN_DOC_CHARS for doc in documents)
    assert len(set(documents)) == len(documents)
    assert any(doc.startswith("Module json") for doc in documents)
    # Generated reprs must not leak memory addresses into the corpus.
    assert not any(embedded_corpus._ADDRESS_RE.search(doc) for doc in documents)


def test_corpus_is_cached(corpus_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail() -> list[str]:
        raise AssertionError("corpus rebuilt although the cache file exists")

    monkeypatch.setattr(embedded_corpus, "build_embedded_documents", fail)
    assert ensure_embedded_corpus(str(Path(corpus_path).parent)) == corpus_path


def test_corpus_concurrent_builds(corpus_path: str, tmp_path: Path) -> None:
    # Several builders racing on one cache directory all return the same,
    # complete file and leave no temporary files behind.
    with ThreadPoolExecutor(max_workers=4) as pool:
        paths = list(pool.map(lambda _: ensure_embedded_corpus(str(tmp_path)), range(4)))
    assert len(set(paths)) == 1
    assert Path(paths[0]).read_bytes() == Path(corpus_path).read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == [Path(corpus_path).name]


def test_corpus_failed_build_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_replace(src: str, dst: str) -> None:
        raise OSError("simulated crash before publishing")

    monkeypatch.setattr(embedded_corpus.os, "replace", broken_replace)
    with pytest.raises(OSError, match="simulated"):
        ensure_embedded_corpus(str(tmp_path))
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ tokenizer


def test_tokenizer_round_trip_and_specials(tokenizer: Tokenizer) -> None:
    assert tokenizer.n_words == 2048
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (1, 2, -1)

    text = "Return a formatted dump of the tree.\n    x = 12345\tÜnïcode ☃ 漢字"
    plain = tokenizer.encode(text, bos=False, eos=False)
    assert tokenizer.decode(plain) == text
    assert tokenizer.encode(text, bos=True, eos=False) == [tokenizer.bos_id] + plain
    assert tokenizer.encode(text, bos=False, eos=True) == plain + [tokenizer.eos_id]
    framed = tokenizer.encode(text, bos=True, eos=True)
    assert framed == [tokenizer.bos_id] + plain + [tokenizer.eos_id]
    assert tokenizer.decode(framed) == text
    assert tokenizer.decode(torch.tensor(plain)) == text
    assert all(0 <= i < tokenizer.n_words for i in framed)


def test_tokenizer_requires_explicit_bos_eos(tokenizer: Tokenizer) -> None:
    with pytest.raises(TypeError):
        tokenizer.encode("hello")  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        tokenizer.encode("hello", True, True)  # type: ignore[misc]


def test_tokenizer_path_resolves_against_repo_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    # Relative on purpose: the path the configs ship, read from elsewhere than the checkout.
    assert build_tokenizer("torchtitan/datasets/assets/tokenizer.model").n_words == 2048


def test_tokenizer_errors(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.model")
    with pytest.raises(FileNotFoundError, match="train_tokenizer.py") as info:
        build_tokenizer(missing)
    assert "nope.model" in str(info.value)

    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"this is not a sentencepiece model")
    with pytest.raises(ValueError, match="garbage.model"):
        build_tokenizer(str(garbage))


# -------------------------------------------------------------------- packing


def test_packing_matches_reference(corpus_path: str, tokenizer: Tokenizer) -> None:
    steps, batch = 6, 4
    got = take(make_loader(tokenizer, batch=batch), steps)
    # The first few documents are more than enough for 24 windows.
    expected = packed_windows(tokenizer, read_corpus(corpus_path)[:20])[: steps * batch]
    assert len(expected) == steps * batch
    for step, (inputs, labels) in enumerate(got):
        assert inputs.shape == labels.shape == (batch, SEQ_LEN)
        assert inputs.dtype == labels.dtype == torch.long
        for row in range(batch):
            window = expected[step * batch + row]
            assert inputs[row].tolist() == window[:-1]
            assert labels[row].tolist() == window[1:]


def test_packing_document_boundaries(tokenizer: Tokenizer, tmp_path: Path) -> None:
    documents = ["first document " * 5, "second one", "third document, a bit longer " * 4]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents), encoding="utf-8")
    loader = make_loader(tokenizer, batch=1, dataset_path=str(path), seq_len=8, infinite=False,
                         cache_dir=str(tmp_path / "cache"))
    samples = [(x[0], y[0]) for x, y in loader]
    inputs = [x.tolist() for x, _ in samples]
    labels = [y.tolist() for _, y in samples]
    # Labels are the inputs shifted by one within each window.
    for x, y in zip(inputs, labels):
        assert x[1:] == y[:-1]
    # Windows are consecutive, non-overlapping slices of the document stream.
    stream = [token for doc in documents for token in tokenizer.encode(doc, bos=True, eos=True)]
    rebuilt = [token for x, y in zip(inputs, labels) for token in x + y[-1:]]
    assert len(stream) - len(rebuilt) < 9
    assert rebuilt == stream[: len(rebuilt)]
    # Every document starts with BOS and ends with EOS, even across windows.
    assert rebuilt[0] == tokenizer.bos_id
    assert rebuilt.count(tokenizer.bos_id) == len(documents)
    eos_positions = [i for i, token in enumerate(rebuilt) if token == tokenizer.eos_id]
    assert len(eos_positions) >= 2
    for position in eos_positions:
        if position + 1 < len(rebuilt):
            assert rebuilt[position + 1] == tokenizer.bos_id


def test_loaders_are_deterministic(corpus_path: str, tokenizer: Tokenizer) -> None:
    first = take(make_loader(tokenizer, batch=2, rank=1, degree=2), 5)
    second = take(make_loader(tokenizer, batch=2, rank=1, degree=2), 5)
    for (x1, y1), (x2, y2) in zip(first, second):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


# ------------------------------------------------------------- DP invariance


def test_dp_ranks_are_disjoint_and_cover_global_batch(corpus_path: str, tokenizer: Tokenizer) -> None:
    steps = 3
    reference = take(make_loader(tokenizer, batch=8), steps)
    index_of = {
        tuple(row.tolist()): step * 8 + i for step, (inputs, _) in enumerate(reference) for i, row in enumerate(inputs)
    }
    assert len(index_of) == steps * 8  # rows are distinct, so content identifies the sample

    seen: dict[int, set[int]] = {}
    for rank in range(4):
        for step, (inputs, _) in enumerate(take(make_loader(tokenizer, batch=2, rank=rank, degree=4), steps)):
            indices = {index_of[tuple(row.tolist())] for row in inputs}
            # Rank r gets the contiguous block [s*8 + 2r, s*8 + 2r + 2).
            assert indices == {step * 8 + rank * 2, step * 8 + rank * 2 + 1}
            seen.setdefault(step, set())
            assert not (seen[step] & indices)
            seen[step] |= indices
    for step in range(steps):
        assert seen[step] == set(range(step * 8, (step + 1) * 8))


def test_global_stream_is_independent_of_dp_degree(corpus_path: str, tokenizer: Tokenizer) -> None:
    steps = 4
    d1 = global_batches(tokenizer, batch=8, degree=1, steps=steps)
    d2 = global_batches(tokenizer, batch=4, degree=2, steps=steps)
    d4 = global_batches(tokenizer, batch=2, degree=4, steps=steps)
    for step in range(steps):
        assert torch.equal(d1[step], d2[step])
        assert torch.equal(d1[step], d4[step])


def test_gradient_accumulation_sees_the_same_global_batch(corpus_path: str, tokenizer: Tokenizer) -> None:
    full = take(make_loader(tokenizer, batch=8), 2)
    micro = take(make_loader(tokenizer, batch=4), 4)
    for step in range(2):
        assert torch.equal(full[step][0], torch.cat([micro[2 * step][0], micro[2 * step + 1][0]]))


# ---------------------------------------------------------------- checkpoints


def test_resume_continues_exactly(corpus_path: str, tokenizer: Tokenizer) -> None:
    uninterrupted = take(make_loader(tokenizer, batch=2, rank=1, degree=2), 6)

    loader = make_loader(tokenizer, batch=2, rank=1, degree=2)
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    state = copy.deepcopy(loader.state_dict())
    assert state["dataset_state"]["next_window"] == 3 * 4
    assert state["dataset_state"]["epoch"] == 0

    resumed = make_loader(tokenizer, batch=2, rank=1, degree=2)
    resumed.load_state_dict(state)
    for expected, got in zip(uninterrupted[3:], take(resumed, 3)):
        assert torch.equal(expected[0], got[0]) and torch.equal(expected[1], got[1])


def test_resume_with_different_dp_degree(corpus_path: str, tokenizer: Tokenizer) -> None:
    reference = global_batches(tokenizer, batch=8, degree=1, steps=5)

    # Train two steps with D=2, B=4; every rank's state names the same position.
    states = []
    for rank in range(2):
        loader = make_loader(tokenizer, batch=4, rank=rank, degree=2)
        take(loader, 2)
        states.append(copy.deepcopy(loader.state_dict()))
    assert states[0]["dataset_state"] == states[1]["dataset_state"]

    # Resume with D=4, B=2 from rank 0's checkpoint.
    per_rank = []
    for rank in range(4):
        loader = make_loader(tokenizer, batch=2, rank=rank, degree=4)
        loader.load_state_dict(states[0])
        per_rank.append(take(loader, 3))
    for step in range(3):
        merged = torch.cat([per_rank[rank][step][0] for rank in range(4)])
        assert torch.equal(merged, reference[2 + step])


def test_resume_rejects_other_seq_len(corpus_path: str, tokenizer: Tokenizer) -> None:
    loader = make_loader(tokenizer, batch=2)
    take(loader, 1)
    state = loader.state_dict()
    other = make_loader(tokenizer, batch=2, seq_len=SEQ_LEN * 2)
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="seq_len"):
        take(other, 1)


# ------------------------------------------------------------- end of data


@pytest.fixture
def small_jsonl(tmp_path: Path, tokenizer: Tokenizer) -> tuple[str, list[str]]:
    documents = [f"Document number {i}: " + "some words to pack " * (i + 2) for i in range(10)]
    path = tmp_path / "small.jsonl"
    path.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in documents), encoding="utf-8")
    return str(path), documents


def test_local_jsonl_matches_reference(small_jsonl: tuple[str, list[str]], tokenizer: Tokenizer) -> None:
    path, documents = small_jsonl
    windows = packed_windows(tokenizer, documents)
    loader = make_loader(tokenizer, batch=1, dataset_name="ignored", dataset_path=path, infinite=False)
    got = [inputs[0].tolist() for inputs, _ in loader]
    assert got == [window[:-1] for window in windows]

    # The same records as Parquet go through the "parquet" builder.
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    parquet_path = Path(path).with_suffix(".parquet")
    pq.write_table(pa.table({"text": documents}), parquet_path)
    loader = make_loader(tokenizer, batch=1, dataset_path=str(parquet_path), infinite=False)
    assert [inputs[0].tolist() for inputs, _ in loader] == got


def test_local_text_file_and_directory(tmp_path: Path, tokenizer: Tokenizer) -> None:
    paragraphs = ["The first paragraph.\nIt has two lines.", "The second paragraph " * 8, "Third " * 20]
    directory = tmp_path / "texts"
    directory.mkdir()
    (directory / "a.txt").write_text("\n\n".join(paragraphs[:2]), encoding="utf-8")
    (directory / "b.txt").write_text(paragraphs[2], encoding="utf-8")

    windows = packed_windows(tokenizer, paragraphs, seq_len=8)
    for path in (directory, directory / "a.txt"):
        expected = windows if path == directory else packed_windows(tokenizer, paragraphs[:2], seq_len=8)
        loader = make_loader(tokenizer, batch=1, dataset_path=str(path), seq_len=8, infinite=False)
        assert [inputs[0].tolist() for inputs, _ in loader] == [window[:-1] for window in expected]


def test_infinite_restarts_and_finite_stops(small_jsonl: tuple[str, list[str]], tokenizer: Tokenizer) -> None:
    path, documents = small_jsonl
    n_windows = len(packed_windows(tokenizer, documents))
    global_batch = 2 * 2
    per_epoch = n_windows // global_batch
    assert per_epoch >= 2 and n_windows % global_batch != 0  # exercises the dropped tail

    for rank in range(2):
        finite = list(make_loader(tokenizer, batch=2, rank=rank, degree=2, dataset_path=path, infinite=False))
        assert len(finite) == per_epoch  # every rank stops after the same number of batches

        infinite = make_loader(tokenizer, batch=2, rank=rank, degree=2, dataset_path=path)
        batches = take(infinite, 2 * per_epoch + 1)
        for step in range(per_epoch):
            assert torch.equal(batches[step][0], finite[step][0])
            assert torch.equal(batches[per_epoch + step][0], finite[step][0])
        state = infinite.state_dict()["dataset_state"]
        assert state["epoch"] == 2 and state["next_window"] == global_batch


def test_too_small_dataset_is_an_error(tmp_path: Path, tokenizer: Tokenizer) -> None:
    path = tmp_path / "tiny.jsonl"
    path.write_text(json.dumps({"text": "hi"}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="fewer than one global batch"):
        take(make_loader(tokenizer, batch=2, dataset_path=str(path)), 1)


# ---------------------------------------------------------------- arguments


def test_registry_and_errors(tokenizer: Tokenizer, tmp_path: Path) -> None:
    assert {"embedded", "c4"} <= set(DATASETS)

    with pytest.raises(ValueError, match="embedded") as info:
        make_loader(tokenizer, batch=2, dataset_name="no_such_dataset")
    assert "c4" in str(info.value) and "no_such_dataset" in str(info.value)

    missing = str(tmp_path / "missing.jsonl")
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        make_loader(tokenizer, batch=2, dataset_path=missing)

    (tmp_path / "data.csv").write_text("text\nhello\n")
    with pytest.raises(ValueError, match="unsupported suffix"):
        make_loader(tokenizer, batch=2, dataset_path=str(tmp_path / "data.csv"))

    for bad in (dict(rank=2, degree=2), dict(rank=-1, degree=2), dict(degree=0), dict(batch=0)):
        options = dict(batch=2, rank=0, degree=1)
        options.update(bad)
        with pytest.raises(ValueError, match="dp_rank|dp_degree|local_batch_size"):
            make_loader(tokenizer, **options)
    with pytest.raises(ValueError, match="seq_len"):
        make_loader(tokenizer, batch=2, seq_len=0)


def test_missing_text_field_is_reported(tmp_path: Path, tokenizer: Tokenizer) -> None:
    path = tmp_path / "other.jsonl"
    path.write_text(json.dumps({"content": "hello there " * 50}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="'text'"):
        take(make_loader(tokenizer, batch=1, dataset_path=str(path)), 1)


# ------------------------------------------------------------- held-out split


def _split_loader(tokenizer: Tokenizer, path: Path, split: HeldOutSplit | None, **layout):
    options = dict(batch=1, dataset_path=str(path), seq_len=8, infinite=False, cache_dir=str(path.parent / "cache"))
    options.update(layout)
    return make_loader(tokenizer, split=split, **options)


def test_held_out_split_is_a_function_of_the_text_and_the_seed() -> None:
    documents = [f"document {i}: " + "words " * (i % 7) for i in range(2000)]
    split = HeldOutSplit(0.1, seed=3)
    held = {d for d in documents if split.held_out(d)}
    assert 0.08 < len(held) / len(documents) < 0.12  # independent draws: the fraction on average
    assert {d for d in documents if HeldOutSplit(0.1, seed=3).held_out(d)} == held  # any process, any order
    assert {d for d in documents if HeldOutSplit(0.1, seed=4).held_out(d)} != held  # another seed, others
    for bad in (0.0, 1.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="fraction"):
            HeldOutSplit(bad)


def test_resume_rejects_another_split(tokenizer: Tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(50)), encoding="utf-8")
    state = _split_loader(tokenizer, path, HeldOutSplit(0.1)).dataset.state_dict()
    assert state["split"] == {"fraction": 0.1, "seed": 0, "side": "training"}
    _split_loader(tokenizer, path, HeldOutSplit(0.1)).dataset.load_state_dict(state)
    for other in (None, HeldOutSplit(0.2), HeldOutSplit(0.1, seed=1)):
        with pytest.raises(ValueError, match="split"):
            _split_loader(tokenizer, path, other).dataset.load_state_dict(state)
    # Without a split the state has no split entry, so checkpoints from before splits existed still load.
    plain = _split_loader(tokenizer, path, None).dataset.state_dict()
    assert "split" not in plain
    with pytest.raises(ValueError, match="nothing held out"):
        _split_loader(tokenizer, path, HeldOutSplit(0.1)).dataset.load_state_dict(plain)
