"""Checkpoints in an S3 bucket, against moto's S3 server on the loopback (the ``s3_bucket`` fixture).

- Through torchrun and train.py, FSDP 2: a writer killed in the middle of saving step 4
  leaves step 2 as the latest; the restart (async saves) skips the partial step, trains
  steps 3-4 bitwise as the killed run did, and retention deletes what it should.
- In one 2-rank FSDP world: an async save does not hold up the next step (its upload is
  held until that step has finished), a flipped byte in an object is caught by its checksum
  (``load_step`` ends the job naming the object; the latest falls back to the step before and
  trains on bitwise), a SIGTERM saves its step and stops, and one process reads the FSDP
  checkpoint back whole.
- A store that stops answering (moto's server, in a process of its own, stopped by SIGSTOP as a
  save uploads) fails the save within its timeouts, with one line naming the endpoint.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from checkpoint.helpers import FSDP2, checkpoint_tensors, digest, full_model_digests, make_trainer
from conftest import DEBUG_CONFIG, REPO, debug_config, run_torchrun
from dist_harness import run_ranks

from torchtitan.checkpoint import integrity, s3_client
from torchtitan.checkpoint.agreement import Agreement
from torchtitan.checkpoint.location import location
from torchtitan.checkpoint.saver import Saver
from torchtitan.checkpoint.store import read_manifest, scan
from torchtitan.train_step.callbacks import StepEvent, StepPoint

pytestmark = pytest.mark.slow  # every test here starts processes

HERE = Path(__file__).resolve().parent


def _torchrun(script: Path, dump: Path, *overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_torchrun(
        script, "--job.config_file", DEBUG_CONFIG, f"--job.dump_folder={dump}", "--job.print_args=false",
        "--metrics.enable_tensorboard=false", "--training.deterministic", "--checkpoint.enable_checkpoint",
        "--parallelism.data_parallel_shard_degree=2", *overrides, env={"OMP_NUM_THREADS": "1", **(env or {})})


def _step_lines(log: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"\[rank0\].*INFO step: (\d+)  (loss: \S+)", log)}


def _all_files_verify(step_folder) -> bool:
    checksums = read_manifest(step_folder)["checksums"]
    return integrity.bad_files(step_folder, checksums, set(checksums["files"])) == []


def test_a_killed_writer_leaves_the_last_committed_step_and_the_restart_resumes_bitwise(s3_bucket, tmp_path):
    folder = f"{s3_bucket.url}/run"
    run = ["--training.steps=6", "--checkpoint.interval=2", "--metrics.log_freq=1", f"--checkpoint.folder={folder}",
           "--checkpoint.keep_latest_k=1"]
    crashed = _torchrun(HERE / "crash_entry.py", tmp_path, *run,
                        env={"CRASH_AT_STEP": "4", "CRASH_IN_FOLDER": "step-4"})
    assert crashed.returncode != 0
    listing = scan(location(folder))
    # Rank 0 died after uploading its shard of step 4: the objects are there, the manifest is not.
    assert sorted(listing.committed) == [2] and sorted(listing.partial) == [4], crashed.stderr[-3000:]
    assert s3_bucket.fs.exists(f"{s3_bucket.name}/run/step-4/__0_0.distcp")
    assert not (tmp_path / "checkpoint").exists()  # nothing went to the local dump folder

    restarted = _torchrun(REPO / "train.py", tmp_path, *run, "--checkpoint.async_mode=async")
    log = restarted.stderr
    assert restarted.returncode == 0, log[-3000:]
    assert re.search(r"skipping s3://\S+/run/step-4: an incomplete save", log), log[-3000:]
    assert re.search(r"loaded s3://\S+/run/step-2 ", log), log[-3000:]
    before, after = _step_lines(crashed.stderr), _step_lines(log)
    assert sorted(after) == [3, 4, 5, 6]
    assert after[3] == before[3] and after[4] == before[4]
    listing = scan(location(folder))
    # keep_latest_k=1 deleted step 4 once step 6 committed; step 2, which this run loaded, is kept.
    assert sorted(listing.committed) == [2, 6] and not listing.partial
    assert _all_files_verify(listing.committed[6])


def _async_then_corrupt(rank: int, world_size: int, dump: str, folder: str) -> dict:
    common = [*FSDP2, "--training.steps=4", "--checkpoint.interval=2", f"--checkpoint.folder={folder}",
              "--comm.train_timeout_seconds=60"]
    step_3_done = threading.Event()
    upload = integrity.RemoteChecksummingWriter.write_data

    def held_upload(self, plan, planner):
        # The async save of step 2 uploads only once step 3 has trained: a save that held up the
        # training loop would wait here until the timeout and fail the save.
        if "step-2" in str(self.path) and not step_3_done.wait(90):
            raise RuntimeError("step 3 never finished while the async save of step 2 was uploading")
        return upload(self, plan, planner)

    integrity.RemoteChecksummingWriter.write_data = held_upload
    trainer = make_trainer(dump, *common, "--checkpoint.async_mode=async")
    pending_at_3: list[bool] = []
    maybe_save = trainer.checkpointer.maybe_save

    def after_step(step: int) -> bool:
        if step == 3:
            pending = trainer.checkpointer.saver.pending
            pending_at_3.append(pending is not None and pending.step == 2 and not pending.future.done())
            step_3_done.set()
        return maybe_save(step)

    trainer.checkpointer.maybe_save = after_step
    out = {"straight": trainer.train(), "straight_weights": full_model_digests(trainer), "pending_at_3": pending_at_3}
    integrity.RemoteChecksummingWriter.write_data = upload

    dist.barrier()
    shard = location(folder) / "step-4" / "__1_0.distcp"
    if rank == 0:
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.fs.pipe_file(shard.path, bytes(data))
    dist.barrier()
    try:
        make_trainer(dump, *common, "--checkpoint.load_step=4").checkpointer.load()
        out["explicit"] = "loaded"
    except RuntimeError as e:
        out["explicit"] = str(e)
    resumed = make_trainer(dump, *common)
    out["resumed"] = resumed.train()
    out["resumed_weights"] = full_model_digests(resumed)

    # A preemption: SIGTERM reaches rank 1 during step 5; the ranks agree at that step's check, save it, stop.
    preempted = make_trainer(dump, *common, "--training.steps=8", "--checkpoint.interval=100",
                             "--checkpoint.preemption_check_steps=1")

    def sigterm_in_step_5(event: StepEvent) -> None:
        if event.point is StepPoint.STEP_END and rank == 1 and event.step == 5:
            os.kill(os.getpid(), signal.SIGTERM)

    preempted.callbacks.add(sigterm_in_step_5)
    preempted.train()
    out["preempted_at"] = preempted.step
    return out


def test_async_save_does_not_hold_up_the_step_and_a_corrupted_object_is_caught(s3_bucket, tmp_path):
    folder = f"{s3_bucket.url}/world"
    out = run_ranks(_async_then_corrupt, 2, str(tmp_path), folder, timeout=400)
    shard = f"{folder}/step-4/__1_0.distcp"
    for rank, o in enumerate(out):
        assert o["pending_at_3"] == [True], rank  # step 3 trained while step 2 was still uploading
        assert o["explicit"].startswith(f"--checkpoint.load_step=4: checkpoint {folder}/step-4: file __1_0.distcp "
                                        "is corrupt (checksum "), (rank, o["explicit"], shard)
        assert o["resumed"] == o["straight"][2:], rank  # from step 2, steps 3-4 bitwise as the first time
        assert o["resumed_weights"] == o["straight_weights"], rank
        assert o["preempted_at"] == 5, rank
    listing = scan(location(folder))
    assert sorted(listing.committed) == [2, 4, 5] and not listing.partial
    assert read_manifest(listing.committed[5])["kind"] == "full" and _all_files_verify(listing.committed[5])
    # The resumed run saved step 4 again, over the damaged one: it verifies, and one process reads the
    # FSDP 2 checkpoint whole (another layout), equal to what the ranks held.
    step_4 = listing.committed[4]
    assert _all_files_verify(step_4)
    whole = {k[len("model."):]: digest(v) for k, v in checkpoint_tensors(step_4, "model.").items()}
    assert whole == out[0]["straight_weights"]


# ---- a store that stops answering --------------------------------------------------------------
@pytest.fixture
def stoppable_s3(free_port, monkeypatch) -> Iterator[tuple[subprocess.Popen, str]]:
    """moto's S3 server in a process of its own, which SIGSTOP stalls (the session's ``s3_server`` runs in this
    one): the process and its endpoint, with this test's S3 clients pointed at it; SIGCONT and stopped after."""
    import s3fs

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for var, value in dict(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                           AWS_DEFAULT_REGION="us-east-1", AWS_REQUEST_CHECKSUM_CALCULATION="when_required",
                           AWS_RESPONSE_CHECKSUM_VALIDATION="when_required", NO_PROXY="127.0.0.1").items():
        monkeypatch.setenv(var, value)
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(var, raising=False)
    settings = s3_client.current()
    s3fs.S3FileSystem.clear_instance_cache()  # no client of the session's server is reused
    try:
        _wait_until_it_answers(endpoint, server)
        yield server, endpoint
    finally:
        server.send_signal(signal.SIGCONT)
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        s3fs.S3FileSystem.clear_instance_cache()
        s3_client.configure(settings)


def _wait_until_it_answers(endpoint: str, server: subprocess.Popen) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and server.poll() is None:
        try:
            urllib.request.urlopen(endpoint, timeout=1).close()
            return
        except urllib.error.HTTPError:
            return  # it answered
        except OSError:
            time.sleep(0.05)  # not listening yet
    pytest.fail(f"moto's S3 server did not start at {endpoint} (exit status {server.poll()})")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_store_that_stops_answering_fails_the_save_in_bounded_time_naming_the_endpoint(stoppable_s3, tmp_path,
                                                                                          caplog, monkeypatch):
    """moto's server is stopped (SIGSTOP) as an async save starts uploading: with 1 s timeouts and 2 attempts the
    save fails within seconds, the next step logs one line naming the endpoint, the next save raises it."""
    import s3fs

    server, endpoint = stoppable_s3
    s3_client.configure(s3_client.S3Timeouts(connect_seconds=1, read_seconds=1, max_attempts=2))
    s3fs.S3FileSystem().mkdir("stall")
    folder = location("s3://stall/run")
    upload = integrity.RemoteChecksummingWriter.write_data

    def stall_then_upload(self, plan, planner):
        os.kill(server.pid, signal.SIGSTOP)  # the store stops answering as the save starts uploading
        return upload(self, plan, planner)

    monkeypatch.setattr(integrity.RemoteChecksummingWriter, "write_data", stall_then_upload)
    ck = debug_config(f"--job.dump_folder={tmp_path}").checkpoint
    saver = Saver(ck, folder, cast(Any, None), Agreement(None, folder), rank=0, layout={})
    expected = (rf"^checkpoint step 2 was not saved: the object store at {re.escape(endpoint)} did not answer "
                r"\(.+\) in 2 attempt\(s\) of --checkpoint.s3_connect_timeout_seconds=1 / "
                r"--checkpoint.s3_read_timeout_seconds=1 \(--checkpoint.s3_max_attempts\); check the store")
    started = time.monotonic()
    saver.write(2, "full", {"w": torch.arange(8.0)}, sync=False)
    assert saver.pending is not None
    concurrent.futures.wait([saver.pending.future], timeout=60)
    failed_after = time.monotonic() - started
    with caplog.at_level(logging.ERROR, logger="torchtitan.checkpoint.saver"):
        saver.finish_pending(block=False)  # the next step sees the failure: logged at once, on this rank
    assert len([r for r in caplog.records if re.match(expected, r.getMessage())]) == 1, caplog.text
    with pytest.raises(s3_client.StoreUnansweredError, match=expected):
        saver.finish_pending()  # the next save, or the end: the job ends with that line
    assert failed_after < 20, failed_after  # seen: 3 s (2 attempts of 1 s, a backoff, DCP's cleanup)
    # A synchronous save to the still stalled store: its first listing fails in time, with the same line.
    started = time.monotonic()
    with pytest.raises(s3_client.StoreUnansweredError, match=expected.replace("step 2", "step 3")):
        saver.write(3, "full", {"w": torch.arange(8.0)}, sync=True)
    assert time.monotonic() - started < 20
