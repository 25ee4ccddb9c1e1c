"""scripts/loss_fingerprint.py: its layouts train the same global batch, and a bad layout name is refused."""

from __future__ import annotations

import sys

import pytest
from conftest import load_script

fingerprint = load_script("scripts/loss_fingerprint.py")


def test_every_layout_trains_the_same_global_batch():
    # Sequences per step = local batch x the data-parallel ranks (replica groups count as such).
    for name, (nproc, overrides) in fingerprint.LAYOUTS.items():
        opts = dict(o.lstrip("-").split("=", 1) if "=" in o else (o.lstrip("-"), "true") for o in overrides)
        batch = int(opts["training.batch_size"])
        groups = int(opts.get("fault_tolerance.num_replica_groups", 1))
        dp = (int(opts.get("parallelism.data_parallel_shard_degree", nproc if nproc > 1 else 1))
              * int(opts.get("parallelism.data_parallel_replicate_degree", 1)))
        assert batch * dp * groups == 4, f"{name}: {batch} x {dp} x {groups} sequences per step, not 4"


def test_unknown_layout_is_refused_with_the_known_ones(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["loss_fingerprint.py", "--layouts", "single,nope"])
    with pytest.raises(SystemExit) as exit_info:
        fingerprint.main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown layout(s) ['nope']" in err and "fsdp2" in err
