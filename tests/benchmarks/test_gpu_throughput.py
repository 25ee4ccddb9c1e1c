"""gpu_throughput.py's reading of the peer (benchmarks/peer/peer_torchtitan.py), without a GPU or the peer: the
peer resets the device's peak statistics at every log step, so its memory figure must come from its step lines."""

from __future__ import annotations

import json
import subprocess

import torch
from conftest import load_script

throughput = load_script("benchmarks/gpu_throughput.py")


def _peer_output(reserved_gib: list[float]) -> str:
    """TorchTitan 0.2.2's step lines (colours included) and the runner's PEER line, whose allocated peak is
    read after the peer's last reset: its parameters and optimizer state alone."""
    lines = [f"[titan] INFO - \x1b[31mstep: {i:2d}  \x1b[32mloss:  8.1  \x1b[38;2;54;234;195mmemory: {gib:5.2f}GiB"
             f"(40.00%)  \x1b[34mtps: {40_000 + i:,}  \x1b[36mtflops: 400.0" for i, gib in enumerate(reserved_gib, 1)]
    lines.append("PEER " + json.dumps({"peer_version": "0.2.2", "torch_peak_mem_gib": 28.7}))
    return "\n".join(lines) + "\n"


def test_the_peer_memory_is_its_largest_reserved_peak_over_the_timed_steps(monkeypatch, capsys):
    output = _peer_output([30.0, 58.0, 61.5, 61.0, 60.0])

    def fake_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        return subprocess.CompletedProcess(cmd, 0, stdout=output, stderr="")

    monkeypatch.setattr(throughput.subprocess, "run", fake_run)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "NVIDIA H200")
    peer = throughput.run_peer("torchtitan-eager", layers=4, seq=8192, steps=3, warmup=2, peer_site="/peer")
    assert peer["peak_reserved_gib"] == 61.5  # steps 3-5, not the state-only peak of the PEER line
    assert peer["peak_mem_gib"] is None
    assert peer["tokens_per_s"] == 40_004

    ours = {"variant": "project-eager", "tokens_per_s": 40_002.0, "tflops": 400.0, "mfu_pct": 40.0,
            "peak_mem_gib": 44.5, "peak_reserved_gib": 50.0, "loss_first_last": [8.0, 7.0]}
    throughput.print_summary([ours, peer])
    printed = capsys.readouterr().out
    assert "project-eager / torchtitan-eager (0.2.2): 1.000x tokens/s, reserved peak 50.0 vs 61.5 GiB" in printed
