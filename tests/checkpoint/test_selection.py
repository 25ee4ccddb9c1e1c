"""What the loader says of an incomplete save it cannot load, chosen on one process without a process group."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchtitan.checkpoint.agreement import Agreement
from torchtitan.checkpoint.loader import Loader
from torchtitan.checkpoint.store import commit, tmp_dir

# A checkpoint written here, by one process, on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _committed(folder, step: int) -> None:
    dcp.save({"model": {"w": torch.zeros(2)}}, checkpoint_id=tmp_dir(folder, step), no_dist=True)  # pyright: ignore[reportPrivateImportUsage]
    commit(folder, step, {"kind": "full", "states": ["model"]})


def _leftover(folder, step: int) -> None:
    """An interrupted save of ``step``: DCP files, no manifest, still under its temporary name."""
    tmp = tmp_dir(folder, step)
    tmp.mkdir(parents=True)
    (tmp / "__0_0.distcp").write_bytes(b"x")


def _choose(debug_cfg, tmp_path, caplog) -> tuple[object, list[str]]:
    folder = tmp_path / "checkpoint"
    cfg = debug_cfg(f"--job.dump_folder={tmp_path}", "--checkpoint.enable_checkpoint")
    loader = Loader(cfg.checkpoint, folder, states=None, agreement=Agreement(None, folder), rank=0, layout={})  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING):
        path, _manifest, _listing = loader._choose()
    return path, [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_leftover_with_nothing_committed_is_named_with_its_step_and_what_to_do(debug_cfg, tmp_path, caplog):
    # Issue 60: the run started from scratch without naming the leftover when no checkpoint was committed yet.
    _leftover(tmp_path / "checkpoint", 4)
    path, [line] = _choose(debug_cfg, tmp_path, caplog)
    assert path is None
    assert "holds no complete checkpoint, only an incomplete save of step 4" in line and "step-4.tmp" in line, line
    assert "this run starts from step 0; if another job is still writing it, stop this one or give it another " \
           "--checkpoint.folder, else that save was interrupted and the leftover can be deleted" in line, line
    assert "\n" not in line, line


def test_a_leftover_beside_a_committed_checkpoint_is_skipped_naming_the_one_loaded(debug_cfg, tmp_path, caplog):
    folder = tmp_path / "checkpoint"
    _committed(folder, 2)
    _leftover(folder, 4)
    path, [line] = _choose(debug_cfg, tmp_path, caplog)
    assert path is not None and path.name == "step-2"
    assert "skipping" in line and "step-4.tmp" in line and line.endswith(f"loading {path} instead"), line


def test_the_loader_and_the_preflight_list_the_checkpoint_folder_once(debug_cfg, tmp_path, caplog, monkeypatch):
    # Issue 61 part 5: choosing the checkpoint listed the folder again after its caller had (an object store: a
    # second LIST of the bucket, and a listing that may differ from the one the caller warns of).
    import torchtitan.checkpoint.loader as loader_module
    import torchtitan.checkpoint.selection as selection_module
    import torchtitan.preflight as preflight_module
    from torchtitan.checkpoint import store

    listed = []

    def scan(folder):
        listed.append(folder)
        return store.scan(folder)

    for module in (loader_module, selection_module, preflight_module):
        monkeypatch.setattr(module, "scan", scan)
    folder = tmp_path / "checkpoint"
    _committed(folder, 2)
    path, _lines = _choose(debug_cfg, tmp_path, caplog)
    assert path is not None and path.name == "step-2" and listed == [folder]
    listed.clear()
    cfg = debug_cfg(f"--job.dump_folder={tmp_path}", "--checkpoint.enable_checkpoint")
    preflight_module.check_checkpoint(cfg, 1, lambda: torch.nn.Linear(2, 2))
    assert listed == [folder]
