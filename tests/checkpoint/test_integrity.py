"""Checksums of checkpoint files: recorded while writing, verified at load, a damaged latest checkpoint skipped.

One 2-rank FSDP world trains 4 steps (checkpoints at steps 2 and 4), then one byte in the
middle of rank 1's shard of step 4 is flipped, and the same world loads it three ways:
with ``load_step=4`` (the job ends naming the file), as latest (the restart falls back to
step 2 and trains steps 3-4 bitwise as before), and after the checksums are removed
from the manifest (an old checkpoint: it loads unverified, and the log says so).
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from checkpoint.helpers import FSDP2, full_model_digests, make_trainer
from dist_harness import run_ranks

from torchtitan.checkpoint import integrity, space

COMMON = [*FSDP2, "--training.steps=4", "--checkpoint.interval=2", "--comm.train_timeout_seconds=60"]
SHARD = "__1_0.distcp"


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _flip_one_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _load_error(trainer) -> str:
    try:
        trainer.checkpointer.load()
    except RuntimeError as e:
        return str(e)
    return "loaded"


def _corrupt_then_load(rank: int, world_size: int, dump: str) -> dict:
    lines = _Lines()
    logger = logging.getLogger("torchtitan.checkpoint")
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    first_save_estimates = _record_state_sizes()
    straight = make_trainer(dump, *COMMON)
    out = {"straight": straight.train(), "straight_weights": full_model_digests(straight)}
    out["first_save_estimate"] = first_save_estimates[0]  # step 2's; step 4 goes by step 2's size on disk
    folder = Path(dump) / "checkpoint"
    dist.barrier()
    if rank == 0:
        _flip_one_byte(folder / "step-4" / SHARD)
    dist.barrier()

    lines.lines.clear()
    out["explicit"] = _load_error(make_trainer(dump, *COMMON, "--checkpoint.load_step=4"))
    out["explicit_lines"] = list(lines.lines)

    lines.lines.clear()
    resumed = make_trainer(dump, *COMMON)
    out["resumed"] = resumed.train()
    out["resumed_weights"] = full_model_digests(resumed)
    out["resumed_lines"] = list(lines.lines)

    # Step 4 was saved again by the resumed run; written without checksums, it would load unverified.
    dist.barrier()
    if rank == 0:
        manifest_path = folder / "step-4" / "checkpoint.json"
        out["new_step4_verified"] = _verifies(folder / "step-4")
        manifest = json.loads(manifest_path.read_text())
        del manifest["checksums"]
        manifest_path.write_text(json.dumps(manifest))
    dist.barrier()
    lines.lines.clear()
    old = make_trainer(dump, *COMMON, "--training.steps=5")
    out["old_loaded"] = old.checkpointer.load()
    out["old_lines"] = list(lines.lines)
    return out


def _record_state_sizes() -> list[dict[str, int]]:
    """What ``space.state_sizes`` estimates, call by call, for the states of the saves that follow."""
    estimates: list[dict[str, int]] = []
    measure = space.state_sizes

    def recording(state, prefix=""):
        sizes = measure(state, prefix)
        if not prefix:  # the whole state, not one of its recursive parts
            estimates.append(sizes)
        return sizes

    space.state_sizes = recording
    return estimates


def _verifies(path: Path) -> bool:
    checksums = json.loads((path / "checkpoint.json").read_text())["checksums"]
    return integrity.bad_files(path, checksums, set(checksums["files"])) == []


@pytest.mark.slow
def test_a_flipped_byte_is_caught_and_the_restart_resumes_bitwise_from_the_step_before(tmp_path):
    out = run_ranks(_corrupt_then_load, 2, str(tmp_path), timeout=400)
    shard = tmp_path / "checkpoint" / "step-4" / SHARD
    bad_line = f"checkpoint {shard.parent}: file {SHARD} is corrupt (checksum "
    for rank, o in enumerate(out):
        # load_step=4: the job ends on every rank, naming the file.
        assert o["explicit"].startswith(f"--checkpoint.load_step=4: {bad_line}"), (rank, o["explicit"])
        # Every rank logs the bad file, also the one that does not read it.
        assert sum(line.startswith(bad_line) for line in o["explicit_lines"]) == 1, (rank, o["explicit_lines"])
        assert sum(line.startswith(bad_line) for line in o["resumed_lines"]) == 1, (rank, o["resumed_lines"])
        # The latest: steps 3-4 train again from step 2, bitwise as the first time.
        assert o["resumed"] == o["straight"][2:], rank
        assert o["resumed_weights"] == o["straight_weights"], rank
        # An old checkpoint (no checksums) loads unverified, and rank 0's log says so.
        assert o["old_loaded"] == 4
        unverified = [line for line in o["old_lines"] if "written without checksums" in line]
        assert len(unverified) == (1 if rank == 0 else 0), (rank, o["old_lines"])
    assert any("loaded" in line and "step-2" in line for line in out[0]["resumed_lines"])
    assert out[0]["new_step4_verified"]
    # The space check's estimate for a first save (the ranks' state sizes, united) is on the safe
    # side of what DCP wrote, and not far above it (docs/checkpoint_integrity.md).
    estimate = sum({k: v for o in out for k, v in o["first_save_estimate"].items()}.values())
    written = space.checkpoint_bytes(tmp_path / "checkpoint" / "step-2")
    assert written is not None and written <= estimate <= 1.10 * written, (estimate, written)


def test_checksums_are_those_of_the_files_on_disk(tmp_path):
    """The hashes taken while DCP wrote equal a fresh read of every file, .metadata included."""
    state = {"w": torch.arange(100_000, dtype=torch.float32), "b": torch.ones(3, 5), "meta": {"step": 7}}
    writer = integrity.ChecksummingWriter(str(tmp_path))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=writer, no_dist=True)
    recorded = integrity.collect(tmp_path, writer.metadata_checksum())
    on_disk = {p.name: integrity.file_checksum(p) for p in tmp_path.iterdir()}
    assert recorded == {"algorithm": "xxh3_64", "files": on_disk}
    assert set(on_disk) == {".metadata", "__0_0.distcp"}  # the side file was folded in and removed
    _flip_one_byte(tmp_path / "__0_0.distcp")
    assert integrity.bad_files(tmp_path, recorded, {"__0_0.distcp", ".metadata"}) == [
        f"checkpoint {tmp_path}: file __0_0.distcp is corrupt (checksum "
        f"{integrity.file_checksum(tmp_path / '__0_0.distcp')}, {on_disk['__0_0.distcp']} was written)"]
