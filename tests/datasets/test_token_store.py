"""Token store: preparation (atomic, resumable, workers), window reading, order, resume, bad input."""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import DEBUG_CONFIG, REPO, load_script

from torchtitan.datasets import DataLayout, HeldOutSplit, build_dataloader, build_tokenizer, prepare, store_cache
from torchtitan.datasets.sources import TokenStoreError
from torchtitan.datasets.token_store import TokenStore
from torchtitan.datasets.window_order import WindowPermutation

prepare_main = load_script("scripts/prepare_data.py").main

SEQ = 16


@pytest.fixture(scope="module")
def tokenizer(shipped_tokenizer):
    return build_tokenizer(shipped_tokenizer)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, list[str]]:
    """A jsonl of 120 short, distinct documents."""
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    docs = [" ".join(words[(i * 7 + j) % len(words)] for j in range(5 + i % 11)) + f" number {i}." for i in range(120)]
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path, docs


@pytest.fixture(scope="module")
def store(corpus, tokenizer, tmp_path_factory) -> Path:
    """The corpus prepared with the command line, two worker processes, small shards."""
    out = tmp_path_factory.mktemp("stores") / "docs"
    prepare_main([str(corpus[0]), str(out), "--workers", "2", "--shard-mb", "0.001", "--no-progress"])
    return out


def reference_stream(tokenizer, docs: list[str]) -> list[int]:
    stream: list[int] = []
    for d in docs:
        stream += tokenizer.encode(d, bos=True, eos=True)
    return stream


def loader(path, tokenizer, *, batch=2, rank=0, degree=1, **kw):
    return build_dataloader(dataset_name="ignored", dataset_path=str(path), tokenizer=tokenizer,
                            layout=DataLayout(SEQ, batch, rank, degree), **kw)


def take(dl, n):
    it = iter(dl)
    return [next(it) for _ in range(n)]


def global_batches(path, tokenizer, degree, steps, batch, **kw):
    per_rank = [take(loader(path, tokenizer, batch=batch, rank=r, degree=degree, **kw), steps) for r in range(degree)]
    return [torch.cat([per_rank[r][s][0] for r in range(degree)]) for s in range(steps)]


# ---------------------------------------------------------------- contents


@pytest.mark.slow
def test_store_holds_the_packed_stream(store, corpus, tokenizer):
    _, docs = corpus
    s = TokenStore(store)
    assert s.dtype == np.uint16 and len(s.shard_files) > 3  # several shards: windows cross shard edges
    stream = reference_stream(tokenizer, docs)
    assert s.n_tokens == len(stream) and s.read(0, s.n_tokens).tolist() == stream
    ends = np.concatenate([np.load(str(f).replace(".bin", ".docs.npy")) + s.starts[i]
                           for i, f in enumerate(s.shard_files)])
    assert ends.tolist() == np.cumsum([len(tokenizer.encode(d, bos=True, eos=True)) for d in docs]).tolist()
    assert prepare._dtype_for(70000) == np.uint32
    # Unshuffled, the loader gives the plain windows in order.
    window = SEQ + 1
    got = [x[0].tolist() for x, _ in take(loader(store, tokenizer, batch=1, shuffle=False), 5)]
    assert got == [stream[i * window : i * window + SEQ] for i in range(5)]


def test_permutation_is_a_seeded_bijection():
    for n in (1, 2, 3, 17, 1000, 4097):
        p = WindowPermutation(n, seed=5, epoch=0)(np.arange(n))
        assert sorted(p.tolist()) == list(range(n))
    a = WindowPermutation(1000, 5, 0)(np.arange(1000))
    few = np.array([0, 7, 999, 500])  # small requests take the pure-Python path: it must agree
    assert np.array_equal(WindowPermutation(1000, 5, 0)(few), a[few])
    assert not np.array_equal(a, np.arange(1000))
    assert np.array_equal(a, WindowPermutation(1000, 5, 0)(np.arange(1000)))
    assert not np.array_equal(a, WindowPermutation(1000, 5, 1)(np.arange(1000)))
    assert not np.array_equal(a, WindowPermutation(1000, 6, 0)(np.arange(1000)))
    # O(1) per index: one window far into a huge epoch, without building anything of that size.
    assert 0 <= int(WindowPermutation(10**12, 5, 0)(np.array([10**12 - 1]))[0]) < 10**12


@pytest.mark.slow
def test_shuffled_stream_is_independent_of_dp_degree_and_accumulation(store, tokenizer):
    d1 = global_batches(store, tokenizer, 1, 3, 8)
    d4 = global_batches(store, tokenizer, 4, 3, 2)
    micro = take(loader(store, tokenizer, batch=4), 6)
    for step in range(3):
        assert torch.equal(d1[step], d4[step])
        assert torch.equal(d1[step], torch.cat([micro[2 * step][0], micro[2 * step + 1][0]]))
    plain = global_batches(store, tokenizer, 1, 1, 8, shuffle=False)[0]
    assert not torch.equal(plain, d1[0])
    assert not torch.equal(d1[0], global_batches(store, tokenizer, 1, 1, 8, seed=1)[0])


def synthetic(tmp_path_factory_or_path, n_tokens, **kw):
    return TokenStore(prepare.write_synthetic_store(tmp_path_factory_or_path, n_tokens, shard_tokens=1000))


def window_ids(batch: torch.Tensor) -> list[int]:
    return (batch[:, 0] // (SEQ + 1)).tolist()  # synthetic store: token t is t


def test_epochs_reshuffle_and_cover_every_window(tmp_path):
    from torchtitan.datasets.store_dataset import TokenStoreDataset

    s = synthetic(tmp_path, 103 * (SEQ + 1) + 5)  # 103 windows: 12 global batches of 8, 7 windows dropped
    def ranks(infinite, degree=2):
        return [TokenStoreDataset(store=s, layout=DataLayout(SEQ, 4, r, degree),
                                  shuffle=True, infinite=infinite) for r in range(degree)]
    epochs = []
    for data in zip(*ranks(True)):
        epochs.append([w for x, y in data for w in window_ids(x)])
        assert all(torch.equal(x[:, 1:], y[:, :-1]) for x, y in data)
        if len(epochs) == 24:
            break
    first, second = sum(epochs[:12], []), sum(epochs[12:], [])
    assert len(set(first)) == 96 and set(first) <= set(range(103))  # distinct windows, tail dropped
    assert first != second and len(set(second)) == 96
    assert [len(list(r)) for r in ranks(False)] == [12, 12]  # a finite pass stops on every rank together


@pytest.mark.slow
def test_resume_anywhere_at_any_dp_degree(store, tokenizer):
    reference = global_batches(store, tokenizer, 1, 12, 4)
    n_per_epoch = (TokenStore(store).n_tokens // (SEQ + 1)) // 4
    dl = loader(store, tokenizer, batch=2, rank=1, degree=2)
    take(dl, 5)
    state = dl.state_dict()
    assert state["dataset_state"]["next_window"] == 20  # prefetching did not move the saved position
    resumed = loader(store, tokenizer, batch=4)
    resumed.load_state_dict(state)
    for step, (x, _) in enumerate(take(resumed, 7)):
        assert torch.equal(x, reference[5 + step])
    # Resuming is arithmetic: a position in the next epoch is as quick to reach as window 0.
    late = loader(store, tokenizer, batch=4)
    late.load_state_dict({**state, "dataset_state": {**state["dataset_state"], "epoch": 1, "next_window": 4}})
    whole = take(loader(store, tokenizer, batch=4), n_per_epoch + 2)
    assert torch.equal(next(iter(late))[0], whole[n_per_epoch + 1][0])
    other = loader(store, tokenizer, batch=4, seed=3)
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="shuffle_seed"):
        iter(other)  # the loader hands the state to the dataset here


@pytest.mark.slow
def test_prefetch_errors_reach_the_training_thread(store, tokenizer, monkeypatch):
    dl = loader(store, tokenizer, batch=2)
    it = iter(dl)
    next(it)

    def broken(self, start, length):
        raise OSError(errno.EIO, "disk read failed")

    monkeypatch.setattr(TokenStore, "read", broken)
    with pytest.raises(OSError, match="disk read failed"):
        for _ in range(5):
            next(it)


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("prefetch:")]


def test_the_prefetch_thread_is_joined_when_its_iterator_closes(tmp_path):
    from torchtitan.datasets.store_dataset import TokenStoreDataset

    data = TokenStoreDataset(store=synthetic(tmp_path, 40 * (SEQ + 1)), layout=DataLayout(SEQ, 2, 0, 1), name="joined")
    it = iter(data)
    next(it)
    (thread,) = [t for t in _prefetch_threads() if t.name == "prefetch:joined"]
    it.close()
    assert not thread.is_alive()  # joined, not merely told to stop


# A reading thread kept busy in torch code (its batches cost a few hundred matrix products) while the
# interpreter exits without closing the iterator: a thread still in a torch op then is killed as it
# retakes the GIL, and the unwinding through torch's C++ frames aborts the process.
_BUSY_EXIT = """
import sys, torch
from torchtitan.datasets import DataLayout, prepare
from torchtitan.datasets.store_dataset import TokenStoreDataset
from torchtitan.datasets.token_store import TokenStore

real = TokenStoreDataset._batch
a = torch.randn(200, 200)

def busy(self, windows):
    for _ in range(300):
        a @ a
    return real(self, windows)

TokenStoreDataset._batch = busy
store = TokenStore(prepare.write_synthetic_store(sys.argv[1], 40 * 17, shard_tokens=1000))
it = iter(TokenStoreDataset(store=store, layout=DataLayout(16, 2, 0, 1), prefetch=1))
next(it)
print("exiting", flush=True)
sys.exit(0)
"""


@pytest.mark.slow
def test_a_busy_prefetch_thread_does_not_abort_the_interpreters_exit(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    # Without the exit-time join this aborted (SIGABRT, "terminate called without an active exception") 3 runs of 3.
    out = subprocess.run([sys.executable, "-c", _BUSY_EXIT, str(tmp_path / "store")], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0 and "exiting" in out.stdout, (out.returncode, out.stderr[-2000:])


# ---------------------------------------------------------------- preparation


@pytest.mark.slow
def test_interrupted_preparation_is_not_used_and_resumes(corpus, tokenizer, tmp_path, monkeypatch, store):
    path, _ = corpus
    out = tmp_path / "s"
    real_write = prepare._write_array
    calls = {"n": 0}

    def full_disk(target, array):
        if target.suffix == ".bin":
            calls["n"] += 1
            if calls["n"] == 3:
                raise OSError(errno.ENOSPC, "No space left on device", str(target))
        real_write(target, array)

    monkeypatch.setattr(prepare, "_write_array", full_disk)
    args = [str(path), str(out), "--workers", "1", "--shard-mb", "0.001", "--no-progress"]
    with pytest.raises(OSError, match="No space left on device") as info:
        prepare_main(args)
    message = str(info.value)
    assert info.value.errno == errno.ENOSPC and str(out) in message and "finished shards are kept" in message
    assert not out.exists()  # the partial store never takes the final name
    with pytest.raises(TokenStoreError, match="no index.json"):
        loader(tmp_path / "s.partial", tokenizer)

    tokenized = []
    real_shard = prepare._tokenize_shard
    monkeypatch.setattr(prepare, "_write_array", real_write)
    monkeypatch.setattr(prepare, "_tokenize_shard", lambda task: tokenized.append(task[0]) or real_shard(task))
    prepare_main(args)
    assert tokenized[0] == 2  # shards 0 and 1 were kept
    resumed, clean = TokenStore(out), TokenStore(store)
    assert resumed.read(0, resumed.n_tokens).tolist() == clean.read(0, clean.n_tokens).tolist()


def test_malformed_json_line_stops_with_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "broken\n{"text": "x"}\n')
    with pytest.raises(TokenStoreError, match=r"bad\.jsonl:2: malformed JSON"):
        prepare_main([str(bad), str(tmp_path / "out"), "--workers", "1", "--no-progress"])
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_bad_stores_are_named(store, tokenizer, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(store, copy)
    index = json.loads((copy / "index.json").read_text())
    index["tokenizer"]["sha256"] = "0" * 64
    (copy / "index.json").write_text(json.dumps(index))
    with pytest.raises(TokenStoreError, match=re.escape(str(copy)) + ".*prepared with the tokenizer"):
        loader(copy, tokenizer)
    with pytest.raises(TokenStoreError, match="held out"):
        loader(store, tokenizer, split=HeldOutSplit(0.1))

    truncated = tmp_path / "truncated"
    shutil.copytree(store, truncated)
    shard = truncated / "shard_00001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(TokenStoreError, match="shard_00001.bin.*truncated"):
        loader(truncated, tokenizer)

    (truncated / "index.json").unlink()
    with pytest.raises(TokenStoreError, match=re.escape(str(truncated)) + " has no index.json"):
        loader(truncated, tokenizer)

    n = TokenStore(store).n_tokens // (SEQ + 1)
    with pytest.raises(TokenStoreError,
                       match=re.escape(str(store)) + f" holds {n} window.*fewer than one global batch"):
        loader(store, tokenizer, batch=n, degree=2)


def test_held_out_documents_never_reach_the_store(corpus, tokenizer, tmp_path):
    path, docs = corpus
    split = HeldOutSplit(0.2, seed=1)
    out = tmp_path / "split"
    prepare_main([str(path), str(out), "--workers", "1", "--held-out-fraction", "0.2", "--split-seed", "1",
                  "--no-progress"])
    kept = [d for d in docs if not split.held_out(d)]
    assert 0 < len(kept) < len(docs)
    s = TokenStore(out)
    assert s.read(0, s.n_tokens).tolist() == reference_stream(tokenizer, kept)
    take(loader(out, tokenizer, split=split), 1)  # the matching run reads it
    # The other side: a validation store of exactly the held-out documents, in source order.
    held = tmp_path / "held"
    prepare_main([str(path), str(held), "--workers", "1", "--held-out-fraction", "0.2", "--split-seed", "1",
                  "--held-out-side", "--no-progress"])
    h = TokenStore(held)
    assert h.read(0, h.n_tokens).tolist() == reference_stream(tokenizer, [d for d in docs if split.held_out(d)])
    assert h.index["split"] == {"fraction": 0.2, "seed": 1, "side": "held_out"}
    with pytest.raises(TokenStoreError, match="held out"):  # never a training store, whatever its split
        take(loader(held, tokenizer, split=split), 1)
    with pytest.raises(SystemExit, match="give that fraction too"):
        prepare_main([str(path), str(tmp_path / "x"), "--held-out-side", "--no-progress"])


def test_first_use_prepares_once_under_a_lock(corpus, tokenizer, tmp_path, monkeypatch):
    """Ranks starting together: one prepares, the others wait and reuse; a held lock times out clearly."""
    path, _ = corpus
    prepared = []
    real = store_cache.prepare_store
    monkeypatch.setattr(store_cache, "prepare_store", lambda **kw: prepared.append(1) or real(**kw))
    results: list = []

    def rank(r):
        dl = loader(path, tokenizer, rank=r, degree=3, cache_dir=str(tmp_path))
        results.append((r, next(iter(dl))[0]))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3 and prepared == [1]
    stores = [p for p in (tmp_path / "token_stores").iterdir() if p.is_dir()]
    assert len(stores) == 1 and (stores[0] / "index.json").exists()

    lock = tmp_path / "token_stores" / "held.lock"
    with store_cache._file_lock(lock, 5, "x"):
        with pytest.raises(TimeoutError, match="waited 0 s.*held.lock"):
            with store_cache._file_lock(lock, 0.3, "token store y"):
                pass


# ---------------------------------------------------------------- hub streaming mode


def test_streaming_mode_shards_documents_and_resumes_at_its_dp_degree(corpus, tokenizer):
    """The hub mode (c4) on a local file: each DP rank packs only its documents; resume is exact per rank."""
    import datasets

    from torchtitan.datasets.stream_dataset import ShardedStreamDataset

    path, docs = corpus

    def rank(r, degree=2):
        source = datasets.load_dataset("json", data_files=str(path), split="train", streaming=True)
        return ShardedStreamDataset(source=source, text_field="text", tokenizer=tokenizer,
                                    layout=DataLayout(SEQ, 2, r, degree), infinite=False, name="hub")

    r0, r1 = rank(0), rank(1)
    tokens0 = torch.cat([torch.cat([x, y[:, -1:]], 1).flatten() for x, y in r0]).tolist()
    assert tokens0 == reference_stream(tokenizer, docs[0::2])[: len(tokens0)] and len(tokens0) > 200
    it = iter(r1)
    for _ in range(3):
        next(it)
    state = r1.state_dict()
    expected = next(it)[0]
    resumed = rank(1)
    resumed.load_state_dict(state)
    assert torch.equal(next(iter(resumed))[0], expected)
    with pytest.raises(ValueError, match="depends on the DP degree.*token store"):
        rank(0, degree=4).load_state_dict(state)


@pytest.mark.slow
def test_trainer_preflight_names_a_bad_store_before_any_process_group(store, tmp_path):
    import shutil

    from torchtitan.config import ConfigError, ConfigManager
    from torchtitan.preflight import preflight

    bad = tmp_path / "bad"
    shutil.copytree(store, bad)
    (bad / "shard_00002.bin").write_bytes(b"")
    cfg = ConfigManager().parse_args(["--job.config_file", DEBUG_CONFIG,
                                      f"--training.dataset_path={bad}", f"--training.seq_len={SEQ}"])
    with pytest.raises(ConfigError, match=re.escape(str(bad / "shard_00002.bin")) + ".*truncated"):
        preflight(cfg, 1)
    cfg.training.dataset_path = str(store)
    cfg.training.batch_size = 10**4
    with pytest.raises(ConfigError, match="fewer than one global batch"):
        preflight(cfg, 1)


# ----------------------------------------------- stores and positions from before split keys
# Before split keys, a store's index, the cache folder name and the saved data position held the
# split as a sentence: "held_out_fraction=F, split_seed=S", prefixed with "only the documents held
# out by " for the held-out side. These tests write them that way and check they are still used.

LEGACY_TRAINING = "held_out_fraction=0.2, split_seed=1"
LEGACY_HELD_OUT = "only the documents held out by held_out_fraction=0.2, split_seed=1"


def _as_legacy(folder: Path, sentence: str) -> Path:
    index = json.loads((folder / "index.json").read_text())
    index["split"] = sentence
    (folder / "index.json").write_text(json.dumps(index, indent=1))
    return folder


def test_a_store_prepared_before_split_keys_is_still_used(corpus, tokenizer, tmp_path):
    from torchtitan.datasets import open_validation_store

    path, _ = corpus
    split = HeldOutSplit(0.2, seed=1)
    train, held = tmp_path / "train", tmp_path / "held"
    for out, side in ((train, []), (held, ["--held-out-side"])):
        prepare_main([str(path), str(out), "--workers", "1", "--held-out-fraction", "0.2", "--split-seed", "1",
                      *side, "--no-progress"])
    _as_legacy(train, LEGACY_TRAINING)
    _as_legacy(held, LEGACY_HELD_OUT)
    dl = loader(train, tokenizer, split=split)
    take(dl, 1)
    assert dl.dataset.state_dict()["split"] == {"fraction": 0.2, "seed": 1, "side": "training"}
    with pytest.raises(TokenStoreError, match="split_seed=1, but this run holds out .*split_seed=2"):
        loader(train, tokenizer, split=HeldOutSplit(0.2, seed=2))  # and another split is still refused
    with pytest.raises(TokenStoreError, match="held out"):  # a legacy held-out store never trains
        loader(held, tokenizer, split=split)
    kw = dict(dataset_name=None, dataset_path=str(held), train_dataset_name="x", train_dataset_path=str(train),
              tokenizer=tokenizer)
    assert open_validation_store(split=split, **kw).path == held
    with pytest.raises(TokenStoreError, match="this run holds out held_out_fraction=0.1"):
        open_validation_store(split=HeldOutSplit(0.1, seed=1), **kw)


def test_a_cached_store_prepared_before_split_keys_is_still_used(corpus, tokenizer, tmp_path, monkeypatch, caplog):
    """The cache folder was named by a hash of the sentence: that folder is found and read, not prepared again."""
    import hashlib
    import logging

    from torchtitan.datasets.sources import source_fingerprint, tokenizer_fingerprint

    path, docs = corpus
    split = HeldOutSplit(0.2, seed=1)
    legacy_key = {"version": 1, "tokenizer": tokenizer_fingerprint(tokenizer.model_path),
                  "source": source_fingerprint([path]), "split": LEGACY_TRAINING}
    name = "docs-" + hashlib.sha256(json.dumps(legacy_key, sort_keys=True).encode()).hexdigest()[:16]
    legacy = tmp_path / "token_stores" / name
    prepare_main([str(path), str(legacy), "--workers", "1", "--held-out-fraction", "0.2", "--split-seed", "1",
                  "--no-progress"])
    _as_legacy(legacy, LEGACY_TRAINING)

    def no_preparation(**kw):
        raise AssertionError("the legacy cached store should have been used")

    monkeypatch.setattr(store_cache, "prepare_store", no_preparation)
    with caplog.at_level(logging.INFO, logger="torchtitan.datasets.store_cache"):
        dl = loader(path, tokenizer, split=split, cache_dir=str(tmp_path), shuffle=False, infinite=False)
    assert dl.dataset.store.path == legacy
    assert any("prepared before split keys" in r.getMessage() for r in caplog.records)
    kept = [d for d in docs if not split.held_out(d)]
    window = SEQ + 1
    assert next(iter(dl))[0][0].tolist() == reference_stream(tokenizer, kept)[: window - 1]


def test_a_position_saved_before_split_keys_still_loads(corpus, tokenizer, tmp_path):
    """The data position of a checkpoint from before: the split as a sentence, and a taken_in_block of 0."""
    path, _ = corpus
    out = tmp_path / "train"
    prepare_main([str(path), str(out), "--workers", "1", "--held-out-fraction", "0.2", "--split-seed", "1",
                  "--no-progress"])
    old = {"epoch": 0, "next_window": 4, "taken_in_block": 0, "seq_len": SEQ, "local_batch_size": 2, "shuffle": 0,
           "split": LEGACY_TRAINING}
    reference = loader(out, tokenizer, split=HeldOutSplit(0.2, seed=1))
    expected = take(reference, 3)[2][0]
    resumed = loader(out, tokenizer, split=HeldOutSplit(0.2, seed=1))
    resumed.dataset.load_state_dict(old)
    assert torch.equal(take(resumed, 1)[0][0], expected)  # window 4 is the third batch of 2
    other = dict(old, split="held_out_fraction=0.1, split_seed=1")  # an old checkpoint of another split
    with pytest.raises(ValueError, match="checkpoint was taken with held_out_fraction=0.1, split_seed=1 but this "
                                         "run has held_out_fraction=0.2, split_seed=1"):
        loader(out, tokenizer, split=HeldOutSplit(0.2, seed=1)).dataset.load_state_dict(other)
    with pytest.raises(ValueError, match="unrecognised held-out split"):
        loader(out, tokenizer, split=HeldOutSplit(0.2, seed=1)).dataset.load_state_dict(dict(old, split="half"))


# ---------------------------------------------------------------- positions (document-masked attention)


def assert_document_positions(inputs: torch.Tensor, positions: torch.Tensor, bos_id: int) -> None:
    """0 at a window's first token and at each BOS, else one more than the token before."""
    assert positions.dtype == torch.int64 and positions.shape == inputs.shape
    assert (positions[:, 0] == 0).all()
    expected = torch.where(inputs[:, 1:] == bos_id, 0, positions[:, :-1] + 1)
    assert torch.equal(positions[:, 1:], expected)


@pytest.mark.slow
def test_positions_restart_per_document_and_resume_exactly(store, tokenizer):
    plain = take(loader(store, tokenizer, batch=2, rank=1, degree=2), 3)
    dl = loader(store, tokenizer, batch=2, rank=1, degree=2, positions=True)
    batches = take(dl, 2)
    for (x, y, p), (x0, y0) in zip(batches, plain):
        assert torch.equal(x, x0) and torch.equal(y, y0)  # the same windows, positions beside them
        assert_document_positions(x, p, tokenizer.bos_id)
    assert any((p[:, 1:] == 0).any() for _, _, p in batches)  # documents start inside these windows
    state = dl.state_dict()
    resumed = loader(store, tokenizer, batch=2, rank=1, degree=2, positions=True)
    resumed.load_state_dict(state)
    x, _, p = next(iter(resumed))
    assert torch.equal(x, plain[2][0])
    assert torch.equal(p, take(loader(store, tokenizer, batch=2, rank=1, degree=2, positions=True), 3)[2][2])


def test_streamed_batches_carry_positions(corpus, tokenizer):
    import datasets

    from torchtitan.datasets.stream_dataset import ShardedStreamDataset

    source = datasets.load_dataset("json", data_files=str(corpus[0]), split="train", streaming=True)
    stream = ShardedStreamDataset(source=source, text_field="text", tokenizer=tokenizer,
                                  layout=DataLayout(SEQ, 2, 0, 1), infinite=False, name="hub",
                                  positions=True)
    batches = list(stream)
    # Every full batch of the one pass: the corpus' tokens, each document with BOS and EOS, in rows of SEQ + 1.
    tokens = sum(len(tokenizer.encode(doc, bos=True, eos=True)) for doc in corpus[1])
    assert len(batches) == tokens // (2 * (SEQ + 1)) > 0
    for x, _, p in batches:
        assert_document_positions(x, p, tokenizer.bos_id)
    assert any((p[:, 1:] == 0).any() for _, _, p in batches)  # documents start inside these windows


@pytest.mark.slow
def test_block_causal_refuses_a_store_without_document_boundaries(store, tmp_path):
    import shutil

    from torchtitan.config import ConfigError, ConfigManager
    from torchtitan.preflight import preflight

    bad = tmp_path / "no_bos"
    shutil.copytree(store, bad)
    index = json.loads((bad / "index.json").read_text())
    del index["bos_id"]
    (bad / "index.json").write_text(json.dumps(index))
    argv = ["--job.config_file", DEBUG_CONFIG, f"--training.dataset_path={bad}",
            f"--training.seq_len={SEQ}"]
    with pytest.raises(ConfigError, match="records no BOS.*scripts/prepare_data.py.*--model.attn_mask_type=causal"):
        preflight(ConfigManager().parse_args(argv), 1)
    preflight(ConfigManager().parse_args([*argv, "--model.attn_mask_type=causal"]), 1)  # causal needs no boundaries


def test_unknown_mask_type_is_refused_with_the_choices():
    from torchtitan.config import ConfigError, ConfigManager

    with pytest.raises(ConfigError, match="--model.attn_mask_type.*'document'.*choose one of block_causal, causal"):
        ConfigManager().parse_args(["--model.attn_mask_type=document"])
