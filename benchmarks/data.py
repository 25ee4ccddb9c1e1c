#!/usr/bin/env python
"""Data path figures: per-rank loader throughput, time to the first batch after a resume, preparation speed.

    python benchmarks/data.py                  # all sections, one process, prints tables
    python benchmarks/data.py --sections loader resume

``loader``: one rank's tokens/s from the token store at DP degree 1/2/4/8 (rank 0 of D;
every rank does the same work).  ``mixture``: the same for a weighted mixture of three
stores against the one store, at DP degree 1/8/64 (every rank runs the interleave over
the whole global batch).  ``resume``: seconds from ``load_state_dict`` to the first
batch, at window 0, near the end of the embedded store's epoch, and in the middle and at the
end of a synthetic store of 10^6 windows (``--synthetic-windows``).  ``step``: the data share of
an emulated step (100 steps, fewer when ``--steps`` is smaller), with and without the prefetch
thread.  ``prepare``: tokens/s of ``prepare_store`` per worker count on the embedded corpus.  (The
streaming packer every rank ran before the store, the baseline of the first figures in
benchmarks/history.md §7, is gone: no run uses it.)

The ``data:`` share of a training step comes from ``train.py``'s own log line; see
benchmarks/history.md §7 for the command.  The machine is shared: compare ratios from
one run, not figures across runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TOKENIZER = str(REPO / "torchtitan/datasets/assets/tokenizer.model")


def _store_loader(tokenizer, cache, *, seq, batch, rank, degree, path=None):
    from torchtitan.datasets import DataLayout, build_dataloader

    return build_dataloader(dataset_name="embedded", dataset_path=path, tokenizer=tokenizer,
                            layout=DataLayout(seq, batch, rank, degree), cache_dir=cache)


def _time_batches(it, n: int) -> tuple[float, float]:
    next(it)
    wall, cpu = time.perf_counter(), time.process_time()  # process time includes the prefetch thread
    for _ in range(n):
        next(it)
    return time.perf_counter() - wall, time.process_time() - cpu


def bench_loader(tokenizer, cache, seq: int, batch: int, steps: int, rounds: int) -> None:
    print(f"\n## per-rank loader throughput (seq {seq}, local batch {batch}, rank 0 of D, {steps} batches after the "
          f"first; best of {rounds} interleaved rounds)")
    best: dict[tuple[str, int], tuple[float, float]] = {}
    for _ in range(rounds):
        for degree in (1, 2, 4, 8):
            it = iter(_store_loader(tokenizer, cache, seq=seq, batch=batch, rank=0, degree=degree))
            wall, cpu = _time_batches(it, steps)
            old = best.get(degree, (float("inf"), float("inf")))
            best[degree] = (min(old[0], wall), min(old[1], cpu))
    tokens = steps * batch * seq
    print("| DP degree | token store tokens/s (wall) | token store tokens/CPU-s |")
    print("|---|---|---|")
    for degree in (1, 2, 4, 8):
        sw, sc = best[degree]
        print(f"| {degree} | {tokens / sw:,.0f} | {tokens / sc:,.0f} |")


def _mixture_sources(cache: str) -> list[dict]:
    """Three sources: the embedded corpus and its two halves as local files (each prepared into its own store)."""
    from torchtitan.datasets import ensure_embedded_corpus

    lines = Path(ensure_embedded_corpus()).read_text().splitlines(keepends=True)
    halves = []
    for name, part in (("first", lines[: len(lines) // 2]), ("second", lines[len(lines) // 2:])):
        path = Path(cache) / f"{name}.jsonl"
        path.write_text("".join(part))
        halves.append(str(path))
    return [{"dataset": "embedded", "weight": 0.5}, {"path": halves[0], "weight": 0.3},
            {"path": halves[1], "weight": 0.2}]


def bench_mixture(tokenizer, cache, seq: int, batch: int, steps: int, rounds: int) -> None:
    from torchtitan.datasets import DataLayout, build_dataloader

    mix = _mixture_sources(cache)
    print(f"\n## mixture against one store: per-rank loader throughput (seq {seq}, local batch {batch}, rank 0 of D, "
          f"{steps} batches after the first; best of {rounds} interleaved rounds; mixture 0.5/0.3/0.2 of 3 stores)")
    degrees = (1, 8, 64)
    best: dict[tuple[str, int], tuple[float, float]] = {}
    for _ in range(rounds):
        for degree in degrees:
            for kind in ("store", "mixture"):
                loader = build_dataloader(dataset_name="embedded", dataset_path=None, tokenizer=tokenizer,
                                          layout=DataLayout(seq, batch, 0, degree),
                                          cache_dir=cache, mix=mix if kind == "mixture" else None)
                wall, cpu = _time_batches(iter(loader), steps)
                old = best.get((kind, degree), (float("inf"), float("inf")))
                best[(kind, degree)] = (min(old[0], wall), min(old[1], cpu))
    tokens = steps * batch * seq
    print("| DP degree | one store tokens/s (wall) | mixture tokens/s (wall) | one store tokens/CPU-s | "
          "mixture tokens/CPU-s | mixture / store (CPU) |")
    print("|---|---|---|---|---|---|")
    for degree in degrees:
        (sw, sc), (mw, mc) = best[("store", degree)], best[("mixture", degree)]
        print(f"| {degree} | {tokens / sw:,.0f} | {tokens / mw:,.0f} | {tokens / sc:,.0f} | {tokens / mc:,.0f} | "
              f"{sc / mc:.2f} |")


def _first_batch_seconds(make, state: dict) -> float:
    start = time.perf_counter()
    loader = make()  # opening the data counts: a resumed run pays for it too
    loader.load_state_dict(state)
    next(iter(loader))
    return time.perf_counter() - start


def bench_resume(tokenizer, cache, seq: int, batch: int, synthetic_windows: int) -> None:
    from torchtitan.datasets import DataLayout
    from torchtitan.datasets.prepare import write_synthetic_store
    from torchtitan.datasets.store_dataset import TokenStoreDataset
    from torchtitan.datasets.token_store import TokenStore

    loader = _store_loader(tokenizer, cache, seq=seq, batch=batch, rank=0, degree=1)
    n = loader.dataset.n_windows
    end = (n // batch - 1) * batch
    base = {"epoch": 0, "seq_len": seq, "local_batch_size": batch, "shuffle": 0}
    print(f"\n## time to the first batch after a resume (seq {seq}, batch {batch}; embedded store: {n} windows)")
    print("| position | token store s |")
    print("|---|---|")
    for label, window in (("window 0", 0), ("window 800", 800), (f"window {end} (end of epoch)", end)):
        store_s = _first_batch_seconds(
            lambda: _store_loader(tokenizer, cache, seq=seq, batch=batch, rank=0, degree=1).dataset,
            dict(base, next_window=window))
        print(f"| {label} | {store_s:.3f} |")
    synth_seq = 32
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        path = write_synthetic_store(tmp, (synthetic_windows + 1000) * (synth_seq + 1))
        written = time.perf_counter() - t0
        # The first one warms the page cache up.
        for window in (0, 0, synthetic_windows // 2, synthetic_windows - 8 * batch):
            def make():
                return TokenStoreDataset(store=TokenStore(path),
                                         layout=DataLayout(synth_seq, batch, 0, 8), shuffle=True)
            seconds = _first_batch_seconds(make, dict(base, seq_len=synth_seq, next_window=window))
            print(f"| synthetic store, {synthetic_windows + 1000:,} windows of {synth_seq + 1}, DP 8: window "
                  f"{window:,} | {seconds:.3f} |")
        print(f"(writing the synthetic store took {written:.1f} s)")


def bench_prepare(workers_list: list[int], copies: int) -> None:
    from torchtitan.datasets.embedded_corpus import ensure_embedded_corpus
    from torchtitan.datasets.prepare import prepare_store
    from torchtitan.datasets.sources import iter_local_documents
    from torchtitan.datasets.token_store import TokenStore

    text = Path(ensure_embedded_corpus()).read_text()
    corpus = Path(tempfile.mkdtemp()) / "corpus.jsonl"
    corpus.write_text(text * copies)
    print(f"\n## preparation of {copies} copies of the embedded corpus ({corpus.stat().st_size / 2**20:.1f} MiB of "
          "JSON lines, 128 KiB of text per shard)")
    print("| workers | seconds | tokens/s | tokens/s per worker |")
    print("|---|---|---|---|")
    for workers in workers_list:
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            out = prepare_store(documents=iter_local_documents([corpus]), out_dir=Path(tmp) / "s",
                                tokenizer_path=TOKENIZER, source={"fingerprint": "bench"}, workers=workers,
                                shard_chars=128 << 10, progress=False)
            seconds = time.perf_counter() - start
            tokens = TokenStore(out).n_tokens
        print(f"| {workers} | {seconds:.2f} | {tokens / seconds:,.0f} | {tokens / seconds / workers:,.0f} |")
    print("(worker start-up is included)")


def bench_step(tokenizer, cache, seq: int, batch: int, steps: int, step_ms: float, rounds: int) -> None:
    """The data share of a step whose compute (torch matmuls, which release the GIL) takes about ``step_ms``."""
    import torch

    a = torch.randn(256, 256)
    start, reps = time.perf_counter(), 0
    while time.perf_counter() - start < 0.2:
        a @ a
        reps += 1
    per_step = max(1, int(reps * step_ms / 200))

    def compute() -> None:
        for _ in range(per_step):
            a @ a

    print(f"\n## data share of an emulated step (~{step_ms:.0f} ms of torch matmuls; seq {seq}, local batch {batch}, "
          f"{steps} steps, rank 0 of D; best of {rounds} interleaved rounds)")
    from torchtitan.datasets import DataLayout, build_dataloader

    labels = ("token store, no prefetch", "token store, prefetch 2")
    best: dict[tuple[int, str], tuple[float, float, float]] = {}
    for _ in range(rounds):
        for degree in (1, 8):
            for label in labels:
                it = iter(build_dataloader(dataset_name="embedded", dataset_path=None, tokenizer=tokenizer,
                                           layout=DataLayout(seq, batch, 0, degree),
                                           cache_dir=cache, prefetch=0 if "no prefetch" in label else 2))
                next(it)
                compute()
                data = total = cpu = 0.0
                for _ in range(steps):
                    t0, c0 = time.perf_counter(), time.thread_time()
                    next(it)
                    t1, c1 = time.perf_counter(), time.thread_time()
                    compute()
                    data, cpu = data + t1 - t0, cpu + c1 - c0
                    total += time.perf_counter() - t0
                old = best.get((degree, label), (float("inf"),) * 3)
                best[degree, label] = (min(old[0], total / steps), min(old[1], data / steps), min(old[2], cpu / steps))
    print("| DP degree | loader | step ms (wall) | data ms (wall) | data share (wall) "
          "| training-thread CPU ms in data |")
    print("|---|---|---|---|---|---|")
    for (degree, label), (total, data, cpu) in best.items():
        print(f"| {degree} | {label} | {1000 * total:.1f} | {1000 * data:.2f} | {100 * data / total:.1f}% | "
              f"{1000 * cpu:.3f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", nargs="+", default=["loader", "mixture", "resume", "prepare", "step"],
                   choices=["loader", "mixture", "resume", "prepare", "step"])
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=200, help="batches timed per token store setting")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--step-ms", type=float, default=20.0, help="compute time of an emulated training step")
    p.add_argument("--copies", type=int, default=8, help="copies of the embedded corpus to prepare")
    p.add_argument("--rounds", type=int, default=3, help="interleaved repetitions of the loader section")
    p.add_argument("--synthetic-windows", type=int, default=10**6,
                   help="resume: windows of the synthetic store resumed at its middle and end")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from torchtitan.datasets import build_tokenizer

    tokenizer = build_tokenizer(TOKENIZER)
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TORCHTITAN_CACHE"] = cache  # prepared once here, not counted below
        _store_loader(tokenizer, cache, seq=args.seq, batch=args.batch, rank=0, degree=1)
        print(f"load average: {os.getloadavg()[0]:.1f} (2-core machine shared with other work: figures are noisy)")
        if "loader" in args.sections:
            bench_loader(tokenizer, cache, args.seq, args.batch, args.steps, args.rounds)
        if "mixture" in args.sections:
            bench_mixture(tokenizer, cache, args.seq, args.batch, args.steps, args.rounds)
        if "resume" in args.sections:
            bench_resume(tokenizer, cache, args.seq, args.batch, args.synthetic_windows)
        if "step" in args.sections:
            bench_step(tokenizer, cache, args.seq, args.batch, min(100, args.steps), args.step_ms, args.rounds)
    if "prepare" in args.sections:
        bench_prepare(args.workers, args.copies)


if __name__ == "__main__":
    main()
