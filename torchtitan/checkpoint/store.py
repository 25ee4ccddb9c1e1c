"""The checkpoint folder on disk: naming, discovery, validation and the atomic commit.

Nothing here communicates, so ``preflight`` can run it on every rank before any
process group exists, and a bad checkpoint fails the same way everywhere.

Layout of ``<dump_folder>/<checkpoint.folder>``::

    step-10/                 a committed checkpoint: DCP files + .metadata + checkpoint.json
    step-20/
    step-30.tmp/             a save in progress, or one that a crash interrupted

A save writes into ``step-N.tmp``; only when every rank has written its files and
DCP has written ``.metadata`` does rank 0 add ``checkpoint.json`` (the manifest: the
step, what the checkpoint holds, the layout, every file's size and, see ``integrity.py``,
every file's checksum) and rename the folder to ``step-N``. A rename within one folder is atomic on POSIX file
systems, so a checkpoint is either visible and complete or not visible at all. Anything named
``step-N.<suffix>`` is an incomplete leftover and is skipped with a warning.

In an object store (``checkpoint.folder = "s3://bucket/prefix"``, see ``location.py``) there is
no rename: a save writes straight into ``step-N/`` and is committed by its manifest, the
one object written last, with a conditional put that fails when the object exists, so two
writers can never both commit a step. There a ``step-N/`` without ``checkpoint.json`` is
the incomplete leftover.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchtitan.checkpoint.location import Location, RemotePath, put_if_absent, remove_tree

MANIFEST = "checkpoint.json"
DCP_METADATA = ".metadata"
FORMAT_VERSION = 1


class CheckpointKind:
    """What a checkpoint holds: its manifest's ``kind``."""

    FULL = "full"  # everything a resume needs
    WEIGHTS_ONLY = "weights_only"  # the model alone, in export_dtype: the final export
    SEED = "seed"  # the initialized model at step 0, for any layout to start from
    MODEL_ONLY = (WEIGHTS_ONLY, SEED)


_COMMITTED = re.compile(r"^step-(\d+)$")
_PARTIAL = re.compile(r"^step-(\d+)\..+$")


@dataclass(frozen=True)
class Listing:
    """What the checkpoint folder holds: committed checkpoints and incomplete leftovers, by step."""

    committed: dict[int, Location]
    partial: dict[int, list[Location]]

    def latest(self) -> int | None:
        return max(self.committed) if self.committed else None


def step_dir(folder: Location, step: int) -> Location:
    return folder / f"step-{step}"


def tmp_dir(folder: Location, step: int, tag: str = "") -> Location:
    """Where a save of ``step`` is written before its commit; ``tag`` keeps concurrent writers apart
    (fault-tolerant replica groups: ``step-N.tmp-group1``). In an object store: ``step-N`` itself."""
    if isinstance(folder, RemotePath):
        return step_dir(folder, step)
    return folder / f"step-{step}.tmp{tag}"


def scan(folder: Location) -> Listing:
    committed: dict[int, Location] = {}
    partial: dict[int, list[Location]] = {}
    for entry in sorted(folder.iterdir(), key=lambda e: e.name) if folder.is_dir() else []:
        if not entry.is_dir():
            continue
        if match := _COMMITTED.match(entry.name):
            # Locally only a rename makes ``step-N``; in an object store its manifest commits it.
            if isinstance(entry, RemotePath) and not (entry / MANIFEST).is_file():
                partial.setdefault(int(match.group(1)), []).append(entry)
            else:
                committed[int(match.group(1))] = entry
        elif match := _PARTIAL.match(entry.name):
            partial.setdefault(int(match.group(1)), []).append(entry)
    return Listing(committed, partial)


def read_manifest(path: Location) -> dict[str, Any]:
    """The manifest of a committed checkpoint; ValueError naming the folder when unreadable."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise ValueError(f"checkpoint {path} is corrupt: it has no {MANIFEST}") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"checkpoint {path} is corrupt: {MANIFEST} is unreadable ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION:
        raise ValueError(f"checkpoint {path} has an unknown {MANIFEST} format (expected format {FORMAT_VERSION})")
    return manifest


def dcp_reader(path: Location):
    """DCP's reader of a checkpoint folder (the local one, or the fsspec one for an object store) whose
    ``.metadata`` is read by the restricted unpickler: loading a crafted checkpoint runs none of its code."""
    from torchtitan.checkpoint.no_pickle import SafeMetadataFsspecReader, SafeMetadataReader  # DCP: when needed

    if isinstance(path, RemotePath):
        return SafeMetadataFsspecReader(str(path))
    return SafeMetadataReader(str(path))


def read_dcp_metadata(path: Location):
    """DCP's global metadata (tensor names, global shapes, dtypes); ValueError when unreadable or refused."""
    from torchtitan.checkpoint.no_pickle import UnsafeMetadataError

    try:
        return dcp_reader(path).read_metadata()
    except UnsafeMetadataError as e:
        raise ValueError(str(e)) from None  # names the file and what it asked for
    except Exception as e:  # noqa: BLE001 - pickle, OS and truncation errors all mean the same here
        raise ValueError(f"checkpoint {path} is corrupt: {DCP_METADATA} is unreadable ({type(e).__name__}: {e})") \
            from None


def verify(path: Location, expected_shapes: dict[str, tuple[int, ...]] | None) -> tuple[list[str], dict[str, Any]]:
    """Check a committed checkpoint without loading it: (problems, manifest).

    Detects a missing or unreadable manifest or DCP metadata, missing or truncated
    data files (against the sizes the manifest recorded at commit time), and model
    parameters whose names or global shapes differ from ``expected_shapes``.
    """
    try:
        manifest = read_manifest(path)
        metadata = read_dcp_metadata(path)
    except ValueError as e:
        return [str(e)], {}
    problems: list[str] = []
    present = file_sizes(path)  # one listing, also of an object store
    for name, size in sorted(manifest.get("files", {}).items()):
        if name not in present:
            problems.append(f"checkpoint {path} is corrupt: data file {name} is missing")
        elif present[name] != size:
            problems.append(f"checkpoint {path} is corrupt: data file {name} has {present[name]} bytes, "
                            f"{size} were written")
    if expected_shapes is not None and "model" in manifest.get("states", []):
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        saved = {
            key[len("model."):]: tuple(md.size)
            for key, md in metadata.state_dict_metadata.items()
            if key.startswith("model.") and isinstance(md, TensorStorageMetadata)
        }
        problems += shape_problems(path, saved, expected_shapes)
    return problems, manifest


def shape_problems(path: Location, saved: dict[str, tuple[int, ...]],
                   expected: dict[str, tuple[int, ...]]) -> list[str]:
    """One line per parameter that is missing, unexpected or of another shape (at most 5 of each, then a count)."""
    def listed(kind: str, lines: list[str]) -> list[str]:
        shown = lines[:5] + ([f"... and {len(lines) - 5} more"] if len(lines) > 5 else [])
        return [f"checkpoint {path} does not match the model config: {kind}: {'; '.join(shown)}"] if lines else []

    differ_fqns = [fqn for fqn, shape in sorted(expected.items()) if fqn in saved and saved[fqn] != shape]
    experts = _expert_count_problem(path, {f: saved[f] for f in differ_fqns}, expected)
    if experts:
        differ_fqns = [f for f in differ_fqns if not _is_stacked_experts(f)]
    differ = [f"{fqn} is {list(saved[fqn])} in the checkpoint, {list(expected[fqn])} in this config"
              for fqn in differ_fqns]
    missing = sorted(set(expected) - set(saved))
    extra = sorted(set(saved) - set(expected))
    return (experts + listed("shape differs", differ) + listed("parameters the checkpoint lacks", missing)
            + listed("parameters this model lacks", extra))


def _is_stacked_experts(fqn: str) -> bool:
    return fqn.rsplit(".", 2)[-2:-1] == ["experts"]  # every parameter of a MoE's routed experts is [E, ...]


def _expert_count_problem(path: Location, saved: dict[str, tuple[int, ...]],
                          expected: dict[str, tuple[int, ...]]) -> list[str]:
    """One line when the stacked experts ``[E, ...]`` differ in their count E alone (another MoE flavor)."""
    counts = {(saved[f][0], expected[f][0]) for f in saved
              if _is_stacked_experts(f) and saved[f][1:] == expected[f][1:] and saved[f][0] != expected[f][0]}
    if len(counts) != 1:
        return []
    (theirs, ours), = counts
    return [f"checkpoint {path} holds {theirs} experts per MoE layer, this model {ours}: resume it with the "
            "flavor it was saved with (--model.flavor), or start a new run"]


def file_sizes(path: Location) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(path.iterdir(), key=lambda e: e.name)
            if p.is_file() and p.name != MANIFEST}


def _fsync_dir(path: Path) -> None:
    # Makes a rename durable; some file systems do not support it, which only weakens durability.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class CommitRefused(RuntimeError):
    """Another writer committed this step first (its manifest exists): this save is not the checkpoint."""


def commit(folder: Location, step: int, manifest: dict[str, Any], tag: str = "") -> Location:
    """Rank 0, after every rank's files and DCP's metadata are written: manifest, then rename.

    A committed ``step-N`` that already exists (a run resumed from an older step saves
    step N again) is moved aside first and deleted only after the new one is in place.
    In an object store the manifest, put only if absent, is the commit (see the module docstring).
    """
    tmp, final = tmp_dir(folder, step, tag), step_dir(folder, step)
    manifest = {**manifest, "format": FORMAT_VERSION, "step": step, "files": file_sizes(tmp),
                "committed_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if isinstance(final, RemotePath):
        try:
            put_if_absent(final / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
        except FileExistsError:
            raise CommitRefused(f"checkpoint {final} was committed by another writer while this one wrote it; "
                                "two jobs are saving into one checkpoint folder: give each its own "
                                "--checkpoint.folder") from None
        return final
    assert isinstance(folder, Path) and isinstance(tmp, Path)
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    replaced = None
    if final.exists():
        replaced = folder / f"step-{step}.replaced"
        shutil.rmtree(replaced, ignore_errors=True)
        os.rename(final, replaced)
    os.rename(tmp, final)
    _fsync_dir(folder)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    return final


def uncommit(path: Location) -> None:
    """Remove a step's folder, manifest first: it is never seen committed with files missing."""
    if isinstance(path, RemotePath):
        (path / MANIFEST).unlink(missing_ok=True)
    remove_tree(path)


def purge(folder: Location, keep_latest_k: int, protected: set[int]) -> list[Location]:
    """Delete all but the newest ``keep_latest_k`` committed checkpoints, and leftovers older than the newest.

    Never deletes a step in ``protected`` (the checkpoint this run loaded, the one just
    written), the newest committed checkpoint, nor the newest *full* one: a final
    weights-only export does not make the last resumable checkpoint disposable.
    """
    listing = scan(folder)
    newest = listing.latest()
    if keep_latest_k <= 0 or newest is None:
        return []
    keep = set(sorted(listing.committed)[-keep_latest_k:]) | protected | {newest}
    for step in sorted(listing.committed, reverse=True):
        try:
            if read_manifest(listing.committed[step]).get("kind") == CheckpointKind.FULL:
                keep.add(step)
                break
        except ValueError:
            continue  # a damaged checkpoint is no reason to keep an extra one, nor to fail a save
    doomed = [path for step, path in listing.committed.items() if step not in keep]
    # Leftovers of interrupted saves that a newer committed checkpoint supersedes; a
    # newer leftover may be an async save still being written, so it stays.
    doomed += [path for step, paths in listing.partial.items() if step < newest for path in paths]
    for path in doomed:
        uncommit(path)
    return doomed
