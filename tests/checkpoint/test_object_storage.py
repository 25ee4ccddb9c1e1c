"""Checkpoints in object storage, without processes: the folder logic on ``memory://``, the conditional
commit on moto's S3 server, checksums of uploaded objects, states and DCP's ``.metadata`` read without
running a pickle's code, the S3 client's timeouts, and the refusals (malformed URIs among them)."""

from __future__ import annotations

import json
import os
import pickle
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import DEBUG_CONFIG, REPO, debug_config, load_script
from torch.distributed.checkpoint.api import CheckpointException

from torchtitan.checkpoint import integrity, s3_client, store
from torchtitan.checkpoint.loader import _one_line
from torchtitan.checkpoint.location import RemotePath, location, store_problems, uri_problem
from torchtitan.checkpoint.no_pickle import NoPickleLoadPlanner, OldFormatError
from torchtitan.checkpoint.selection import checkpoint_folder

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
_RAN: list[str] = []


def _ran(what: str) -> None:
    _RAN.append(what)


class _Crafted:
    """What a crafted checkpoint holds: unpickling it calls ``_ran`` (any function could be called)."""

    def __reduce__(self):
        return (_ran, ("crafted code",))


def _save(folder, step: int, state: dict, checksums: bool = True):
    """A checkpoint of ``state`` written and committed as rank 0 of one process would; returns its folder."""
    tmp = store.tmp_dir(folder, step)
    writer = integrity.checkpoint_writer(tmp, checksums)
    dcp.save(state, storage_writer=writer, no_dist=True)  # pyright: ignore[reportPrivateImportUsage]
    manifest: dict = {"kind": "full", "states": sorted(state)}
    if isinstance(writer, integrity.ChecksummingWriter):
        manifest["checksums"] = integrity.collect(tmp, writer.metadata_checksum())
    return store.commit(folder, step, manifest)


def _memory(name: str) -> RemotePath:
    folder = location(f"memory://{name}")
    assert isinstance(folder, RemotePath)
    store.remove_tree(folder)
    return folder


def test_read_bytes_refuses_what_is_not_the_files_bytes(monkeypatch):
    folder = _memory("read_bytes/run")
    entry = folder / "manifest.json"
    entry.write_text("{}")
    assert entry.read_bytes() == b"{}"
    monkeypatch.setattr(entry.fs, "cat_file", lambda path: "{}")  # a driver that hands back text
    with pytest.raises(TypeError, match="memory://read_bytes/run/manifest.json: the file system returned a str"):
        entry.read_bytes()


def test_a_remote_step_is_written_in_place_and_committed_by_its_manifest_alone():
    folder = _memory("commit/run")
    assert store.tmp_dir(folder, 2) == store.step_dir(folder, 2)  # no rename: no .tmp folder
    tmp = store.tmp_dir(folder, 2)
    dcp.save({"w": torch.arange(4.0)}, storage_writer=integrity.checkpoint_writer(tmp, True), no_dist=True)
    listing = store.scan(folder)
    assert listing.committed == {} and list(listing.partial) == [2]  # files, no manifest: partial
    path = store.commit(folder, 2, {"kind": "full", "states": ["w"]})
    assert store.scan(folder).committed == {2: path} and store.scan(folder).latest() == 2
    assert store.verify(path, None)[0] == []
    with pytest.raises(store.CommitRefused, match="committed by another writer"):
        store.commit(folder, 2, {"kind": "full", "states": ["w"]})
    # Removing a step takes its manifest first: it is never seen committed with files missing.
    store.uncommit(path)
    assert store.scan(folder) == store.Listing({}, {})


def test_retention_on_a_remote_folder_keeps_newest_k_protected_and_newer_leftovers():
    folder = _memory("purge/run")
    for step in (1, 2, 3, 4):
        _save(folder, step, {"w": torch.full((2,), float(step))}, checksums=False)
    dcp.save({"w": torch.zeros(2)}, storage_writer=integrity.checkpoint_writer(store.step_dir(folder, 5), False),
             no_dist=True)  # a save in flight (or killed): newer than every committed one
    gone = store.purge(folder, keep_latest_k=2, protected={1})
    assert sorted(p.name for p in gone) == ["step-2"]
    listing = store.scan(folder)
    assert sorted(listing.committed) == [1, 3, 4] and list(listing.partial) == [5]


def test_uploaded_objects_carry_their_checksums_and_a_flipped_byte_is_named():
    folder = _memory("sums/run")
    path = _save(folder, 3, {"model": {"w": torch.randn(64)}, "note": "text"})
    checksums = store.read_manifest(path)["checksums"]
    assert checksums["files"] == {p.name: integrity.file_checksum(p) for p in path.iterdir()
                                  if p.name != store.MANIFEST}
    assert not list(path.glob(f"*{integrity.SIDECAR_SUFFIX}"))  # folded into the manifest
    assert integrity.bad_files(path, checksums, set(checksums["files"])) == []
    shard = path / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.fs.pipe_file(shard.path, bytes(data))
    assert integrity.bad_files(path, checksums, {"__0_0.distcp"}) == [
        f"checkpoint {path}: file __0_0.distcp is corrupt (checksum {integrity.file_checksum(shard)}, "
        f"{checksums['files']['__0_0.distcp']} was written)"]


def test_a_second_commit_of_a_step_on_s3_is_refused_by_the_server(s3_bucket):
    folder = location(f"{s3_bucket.url}/run")
    first = _save(folder, 4, {"w": torch.ones(3)})
    written = first.fs.cat_file((first / store.MANIFEST).path)
    with pytest.raises(store.CommitRefused, match="committed by another writer"):
        store.commit(folder, 4, {"kind": "full", "states": ["w"], "writer": "second"})
    # The first writer's manifest stands (the store answered the conditional PUT with 412).
    assert first.fs.cat_file((first / store.MANIFEST).path) == written
    assert sorted(store.scan(folder).committed) == [4]


def test_preflight_names_a_missing_bucket_in_one_line(s3_bucket, tmp_path):
    from torchtitan.preflight import check_checkpoint

    assert store_problems(f"{s3_bucket.url}/run") == []
    cfg = debug_config(f"--job.dump_folder={tmp_path}", "--checkpoint.enable_checkpoint",
                       f"--checkpoint.folder=s3://{s3_bucket.name}-missing/run")
    assert check_checkpoint(cfg, 2, lambda: torch.nn.Linear(1, 1)) == [
        f"--checkpoint.folder=s3://{s3_bucket.name}-missing/run: the bucket s3://{s3_bucket.name}-missing does not "
        "exist (or these credentials cannot see it); create it first"]


def test_a_crafted_value_is_not_unpickled_and_an_old_pickled_state_is_refused():
    folder = _memory("crafted/run")
    path = _save(folder, 1, {"rng": {"rank0": _Crafted()}})
    with pytest.raises(CheckpointException) as raised:  # DCP wraps the planner's error, as on every rank
        dcp.load({"rng": {"rank0": ""}}, storage_reader=store.dcp_reader(path), planner=NoPickleLoadPlanner(),
                 no_dist=True)
    # The loader shares it with the other ranks as one line, not DCP's traceback per rank.
    assert _one_line(raised.value) == (
        "OldFormatError: checkpoint value 'rng.rank0' was written by an older version of this project as a pickle, "
        "which is not loaded (a crafted checkpoint would run code); resume without it "
        "(--checkpoint.exclude_from_loading) or start a new run (UnpicklingError)")
    assert _RAN == []
    # The old format's pickled RNG and LR schedule blobs load as bytes, and are refused, not unpickled.
    from torchtitan.checkpoint.states import BUILTIN

    specs = {spec.name: spec for spec in BUILTIN}
    holders = SimpleNamespace(rank=0, lr_scheduler=SimpleNamespace(load_state_dict=_ran))
    with pytest.raises(OldFormatError, match="RNG state"):
        specs["rng"].apply(holders, {"rank0": b"\x80\x04crafted"})
    with pytest.raises(OldFormatError, match="LR schedule"):
        specs["lr_scheduler"].apply(holders, b"\x80\x04crafted")
    assert _RAN == []


def test_rng_and_schedule_round_trip_through_json_bitwise():
    import random

    from torchtitan.checkpoint.states import _rng_state, _set_rng_state

    random.seed(3)
    torch.manual_seed(4)
    saved = _rng_state()
    json.loads(saved)  # text, not a pickle
    expected = (random.random(), torch.rand(3))
    random.seed(99)
    torch.manual_seed(99)
    _set_rng_state(saved)
    assert random.random() == expected[0] and torch.equal(torch.rand(3), expected[1])


def test_a_uri_folder_is_used_as_given_and_the_remote_refusals_are_one_line_each(tmp_path):
    cfg = debug_config(f"--job.dump_folder={tmp_path}", "--checkpoint.folder=memory://cfg/run")
    # Not joined to the dump folder.
    assert checkpoint_folder(cfg.checkpoint, cfg.job.dump_folder) == location("memory://cfg/run")
    from torchtitan.preflight import check_checkpoint

    ft = debug_config(f"--job.dump_folder={tmp_path}", "--checkpoint.folder=memory://cfg/run",
                      "--checkpoint.enable_checkpoint", "--fault_tolerance.enable")
    problems = check_checkpoint(ft, 2, lambda: torch.nn.Linear(1, 1))
    assert len(problems) == 1 and "fault-tolerant replica groups" in problems[0], problems
    hf = debug_config(f"--job.dump_folder={tmp_path}", "--checkpoint.initial_load_path=memory://weights",
                      "--checkpoint.initial_load_format=hf")
    from torchtitan.checkpoint.formats import check_source

    assert check_source("memory://weights", "hf", None) == [
        "--checkpoint.initial_load_path=memory://weights: hf weights are read from a local folder only; download "
        "them first (an object-store URI takes --checkpoint.initial_load_format=dcp, a checkpoint of this project)"]
    assert hf.checkpoint.initial_load_format == "hf"
    export = load_script("scripts/export_checkpoint.py")
    assert export.main(["memory://cfg/run/step-2", str(tmp_path / "out"), "--format", "hf"]) == 2
    assert not (tmp_path / "out").exists()


def test_initial_weights_load_from_a_uri(tmp_path):
    from torchtitan.checkpoint.formats import check_source, load_into
    from torchtitan.models.common.decoder import Decoder
    from torchtitan.models.llama3 import llama3_flavors

    args = llama3_flavors["debugmodel"]
    torch.manual_seed(0)
    source = Decoder(args)
    folder = _memory("initial/run")
    _save(folder, 5, {"model": source.state_dict()})
    assert check_source("memory://initial/run", "dcp", args) == []
    target = Decoder(args)
    assert load_into(target, "memory://initial/run", "dcp", args) == len(source.state_dict())
    for (name, a), b in zip(source.state_dict().items(), target.state_dict().values()):
        assert torch.equal(a, b), name
    assert REPO.is_dir()


# ---- DCP's .metadata: read by the restricted unpickler everywhere ----------------------------------
class _RunsShell:
    """A crafted ``.metadata``: unpickling it runs a shell command that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


def _crafted_step(folder, marker: Path):
    """A committed step whose ``.metadata`` was replaced by ``_RunsShell``; the refusal line its readers give."""
    step = _save(folder, 1, {"model": {"w": torch.ones(2)}}, checksums=False)
    metadata = step / store.DCP_METADATA
    if isinstance(metadata, RemotePath):
        metadata.fs.pipe_file(metadata.path, pickle.dumps(_RunsShell(marker)))
    else:
        metadata.write_bytes(pickle.dumps(_RunsShell(marker)))
    return step, (f"{metadata} is refused: it names {os.system.__module__}.system, which DCP's metadata never "
                  "holds, so unpickling it could run code (a crafted or foreign file); nothing of it was loaded or run")


def test_a_crafted_metadata_is_refused_by_the_launch_preflight_and_the_export_and_runs_nothing(tmp_path, capsys):
    marker = tmp_path / "ran"
    step, refusal = _crafted_step(tmp_path / "checkpoint", marker)
    train = load_script("train.py")
    # run_llama_train.sh's check before torchrun: exit 2, the refusal naming the file.
    assert train.main(["--preflight_only", "--job.config_file", DEBUG_CONFIG, f"--job.dump_folder={tmp_path}",
                       "--checkpoint.enable_checkpoint"]) == 2
    assert f"config error: {refusal}\n" in capsys.readouterr().err
    export = load_script("scripts/export_checkpoint.py")
    assert export.main([str(step), str(tmp_path / "model.pt")]) == 2
    assert capsys.readouterr().err == f"error: {refusal}\n"
    assert not marker.exists()


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_crafted_metadata_is_refused_where_the_ranks_read_it_and_runs_nothing(tmp_path, where):
    marker = tmp_path / "ran"
    step, refusal = _crafted_step(tmp_path / "checkpoint" if where == "local" else _memory("crafted-md/run"), marker)
    # The loader's choice and verification (as preflight's) read it first...
    problems, _ = store.verify(step, None)
    assert problems == [refusal]
    # ...and DCP's load reads it again through the project's reader: refused as one line, not DCP's fallback.
    with pytest.raises(CheckpointException) as raised:
        dcp.load({"model": {"w": torch.zeros(2)}}, storage_reader=store.dcp_reader(step),
                 planner=NoPickleLoadPlanner(), no_dist=True)
    assert _one_line(raised.value) == f"UnsafeMetadataError: {refusal}"
    assert not marker.exists()


def test_the_restricted_reader_reads_what_dcp_writes_as_dcp_reads_it(tmp_path):
    """Every class a ``.metadata`` of this torch holds is admitted: the result equals DCP's own reader's."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int8,
              torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)
    state = {"model": {str(dtype): torch.zeros(2, 3, dtype=dtype) for dtype in dtypes},
             "train_state": {"step": 3, "text": "x", "list": [1, 2.5, None]}}
    for folder, reader in ((location(tmp_path), FileSystemReader), (_memory("md/run"), FsspecReader)):
        dcp.save(state, storage_writer=integrity.checkpoint_writer(folder, False), no_dist=True)
        ours, theirs = store.read_dcp_metadata(folder), reader(str(folder)).read_metadata()
        assert ours.storage_meta is not None and theirs.storage_meta is not None
        theirs.storage_meta.load_id = ours.storage_meta.load_id  # a fresh id per reader
        assert ours == theirs, folder


# ---- URIs and the S3 client ----------------------------------------------------------------------
@pytest.mark.parametrize(("flag", "uri", "problem"), [
    ("--checkpoint.folder", "s3://", "no bucket after s3://: give s3://bucket/prefix"),
    ("--checkpoint.folder", "s3:///run", "no bucket after s3://: give s3://bucket/prefix"),
    ("--checkpoint.folder", "foo://bucket/run", "unknown storage scheme foo://: give s3://bucket/prefix (another "
     "fsspec scheme such as gs:// or az:// needs its driver), or a local path"),
    ("--checkpoint.initial_load_path", "s3://", "no bucket after s3://: give s3://bucket/prefix"),
])
def test_a_malformed_uri_is_refused_by_name_before_any_rank_starts(tmp_path, monkeypatch, capsys, flag, uri,
                                                                     problem):
    monkeypatch.chdir(tmp_path)  # where fsspec would have made a local folder "s3:"
    train = load_script("train.py")
    assert train.main(["--preflight_only", "--job.config_file", DEBUG_CONFIG, f"--job.dump_folder={tmp_path}",
                       "--checkpoint.enable_checkpoint", f"{flag}={uri}"]) == 2
    assert capsys.readouterr().err == f"config error: {flag}={uri}: {problem}\n"
    with pytest.raises(ValueError, match=f"^{uri}: "):
        location(uri)  # nothing reads or writes through it either
    assert list(tmp_path.iterdir()) == []


def test_uri_problems_name_the_fix_and_pass_paths():
    assert uri_problem("s3:/bucket/run") == "one slash after s3: is a local path, not a URI: give s3://bucket/prefix"
    assert uri_problem("file:///data/ckpt") == "file:// is not needed for a local folder: give the path itself " \
                                               "(/data/ckpt)"
    assert uri_problem("://bucket") == "no storage scheme before ://: give s3://bucket/prefix, or a local path"
    for fine in ("checkpoint", "/data/ckpt", "C:/ckpt", "run:2", "s3://bucket", "s3a://b/run", "memory://x/y"):
        assert uri_problem(fine) is None, fine


def test_the_configured_s3_timeouts_reach_every_s3_client(s3_bucket, tmp_path):
    import s3fs

    cfg = debug_config(f"--job.dump_folder={tmp_path}", f"--checkpoint.folder={s3_bucket.url}/run",
                       "--checkpoint.s3_connect_timeout_seconds=4", "--checkpoint.s3_read_timeout_seconds=7",
                       "--checkpoint.s3_max_attempts=2")
    from torchtitan.preflight import check_checkpoint

    settings = s3_client.current()
    try:
        assert check_checkpoint(cfg, 1, lambda: torch.nn.Linear(1, 1)) == []
        # The project's own file system, and the one DCP's reader makes from the URL on its own.
        for fs in (location(f"{s3_bucket.url}/run").fs, store.dcp_reader(location(f"{s3_bucket.url}/run")).fs.fs):
            config = fs.s3.meta.config
            assert (config.connect_timeout, config.read_timeout, config.retries) == (
                4, 7, {"mode": "standard", "total_max_attempts": 2})
        assert s3fs.S3FileSystem.retries == 1  # s3fs does not multiply botocore's attempts
    finally:
        s3_client.configure(settings)
