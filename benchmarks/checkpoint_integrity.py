"""What checkpoint checksums cost: save and load, with and without them, on one process.

    python benchmarks/checkpoint_integrity.py [--shapes debug,large] [--repeats 5] [--folder /tmp]

The state is what a full checkpoint holds of the model: the weights and AdamW's two
moments (12 bytes a parameter in float32), for the debug model (5.8M parameters, vocabulary
2048) and for the 53M shape of ``benchmarks/ft_heal.py`` (``tiny``: the debug model cut to one
block and 256 words, which checks the script, not the cost). For each repeat, and alternating
the order, it saves with DCP's ``FileSystemWriter`` and with the project's
``ChecksummingWriter`` (plus folding the side files into the manifest, as rank 0 does at
commit), and loads plainly and after verifying every file. Saves fsync as the trainer's do;
loads read from the page cache (just written), so the load figure is the hashing's CPU cost,
not a disk's. Medians of wall and CPU (process) time in ms, and their ratios, all from one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from ft_heal import LARGE  # noqa: E402

from torchtitan.checkpoint import integrity  # noqa: E402
from torchtitan.models.common.decoder import Decoder  # noqa: E402
from torchtitan.models.llama3 import ModelArgs, llama3_flavors  # noqa: E402

SHAPES = ("tiny", "debug", "large")


def _state(shape: str) -> dict:
    if shape in ("debug", "tiny"):
        args = dataclasses.replace(llama3_flavors["debugmodel"], vocab_size=2048, max_seq_len=64)
        if shape == "tiny":
            args = dataclasses.replace(args, vocab_size=256, n_layers=1)
    else:
        args = ModelArgs(**LARGE, max_seq_len=64)
    torch.manual_seed(0)
    model = Decoder(args)
    model.init_weights()
    params = dict(model.named_parameters())
    # AdamW's moments: random, so that nothing compresses or hashes specially.
    moments = {f"{fqn}.{m}": torch.randn_like(p) for fqn, p in params.items() for m in ("exp_avg", "exp_avg_sq")}
    return {"model": {k: v.detach() for k, v in params.items()}, "optimizer": moments}


def _timed(fn) -> tuple[float, float]:
    """(wall ms, CPU ms of this process): hashing adds CPU time, which a loaded machine blurs less than wall time."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return (time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3


def _save(state: dict, folder: Path, checksums: bool, out: dict) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    if checksums:
        writer = integrity.ChecksummingWriter(str(folder))
        dcp.save(state, storage_writer=writer, no_dist=True)
        out.update(integrity.collect(folder, writer.metadata_checksum()))
    else:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)


def _load(template: dict, folder: Path, checksums: dict | None) -> None:
    if checksums is not None:
        from torch.distributed.checkpoint import FileSystemReader

        names = integrity.files_read(template, FileSystemReader(str(folder)).read_metadata())
        assert integrity.bad_files(folder, checksums, names) == []
    dcp.load(template, checkpoint_id=str(folder), no_dist=True)


def run_shape(shape: str, repeats: int, work: Path) -> dict:
    state = _state(shape)
    template = {k: {n: torch.empty_like(t) for n, t in v.items()} for k, v in state.items()}
    plain, checked = work / f"{shape}-plain", work / f"{shape}-checked"
    times: dict[str, list[tuple[float, float]]] = {"save": [], "save+checksums": [], "load": [], "load+verify": []}
    sums: dict = {}
    for i in range(repeats):
        order = [False, True] if i % 2 == 0 else [True, False]
        for on in order:
            times["save+checksums" if on else "save"].append(
                _timed(lambda on=on: _save(state, checked if on else plain, on, sums)))
        for on in order:
            times["load+verify" if on else "load"].append(
                _timed(lambda on=on: _load(template, checked if on else plain, sums if on else None)))
    size = sum(f.stat().st_size for f in plain.iterdir())
    medians = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in times.items()}
    return {"shape": shape, "bytes": size, **medians}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="debug,large")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--folder", default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args()
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown {', '.join(unknown)}; choose from {', '.join(SHAPES)}")
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir=args.folder) as work:
        rows = [run_shape(s, args.repeats, Path(work)) for s in args.shapes.split(",")]
    print("| shape | checkpoint MB | operation | wall ms | with checksums | ratio | CPU ms | with checksums | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        for op, plain, checked in (("save", "save", "save+checksums"), ("load", "load", "load+verify")):
            (pw, pc), (cw, cc) = r[plain], r[checked]
            print(f"| {r['shape']} | {r['bytes'] / 2**20:.1f} | {op} | {pw:.0f} | {cw:.0f} | {cw / pw:.2f} | "
                  f"{pc:.0f} | {cc:.0f} | {cc / pc:.2f} |")


if __name__ == "__main__":
    main()
