"""Every script under benchmarks/ has a smoke run in the suite (tests/script_smoke.py says what each kind checks).

The runs share one process (one torch import for all of them, about 10 s of CPU together); the --help and
import checks run in this process. A script whose smallest real run starts several ranks (seconds of CPU
each), or needs a GPU, the peer or a planner dry run of a large model, is argument-parsed here: ``why``
names what it needs.
"""

from __future__ import annotations

import pytest
from script_smoke import Run, Smoke, call_main, coverage_problems, load, named_paths, run_all, run_key

from torchtitan.metrics.logger import format_step_line

RANKS = "its smallest run starts torchrun ranks (10 s of CPU or more)"
GPU = "needs a CUDA device"
DRY_RUN = "a planner dry run (seconds to minutes of CPU; tests/planning runs the planner's dry runs)"
PEER = "needs the peer (TorchTitan from PyPI, installed apart)"
ONE_STEP = ("--batch", "1", "--seq_len", "16", "--warmup", "0", "--steps", "1")
GPU_THROUGHPUT = ("--smoke", "--layers", "1", "--seq", "16", "--steps", "1", "--warmup", "0", "--one")

TABLE: dict[str, Smoke] = {
    "benchmarks/checkpoint_integrity.py": Smoke(runs=(Run(("--shapes", "tiny", "--repeats", "1", "--folder", "{tmp}"),
                                                          "| tiny |"),)),
    "benchmarks/common.py": Smoke(imports=True),
    "benchmarks/cpu_matmul.py": Smoke(runs=(Run(("--tokens", "8", "--rounds", "1", "--repeats", "1"), "dL/dW"),)),
    "benchmarks/data.py": Smoke(runs=(Run(("--sections", "loader", "mixture", "resume", "step", "prepare", "--seq",
                                           "16", "--batch", "1", "--steps", "1", "--workers", "1", "--copies", "1",
                                           "--rounds", "1", "--step-ms", "0", "--synthetic-windows", "64"),
                                          "tokens/s per worker"),)),
    "benchmarks/document_mask.py": Smoke(runs=(Run(("--kernels", "--shapes", "1x32", "--steps", "1"),
                                                   "per-document"),), why=f"the step comparison: {RANKS}"),
    "benchmarks/footprint.py": Smoke(elsewhere="tests/benchmarks/test_footprint.py"),
    "benchmarks/ft_heal.py": Smoke(help=True, why="two replica groups and a lighthouse, one group killed and healed"),
    "benchmarks/generation.py": Smoke(runs=(Run(("--prompt_lens", "4", "--new_tokens", "2"), "KV cache"),)),
    "benchmarks/gpu_checks.sh": Smoke(bash=True, why=GPU),
    "benchmarks/gpu_frontier.sh": Smoke(bash=True, why=GPU),
    "benchmarks/gpu_moe.sh": Smoke(bash=True, why=GPU),
    "benchmarks/gpu_moe_summary.py": Smoke(runs=(Run(("--write-flavors", "{tmp}", "--layers", "1"),
                                                     "qwen3_30b_a3b_1l"),)),
    "benchmarks/gpu_throughput.py": Smoke(runs=(Run((*GPU_THROUGHPUT, "project-eager"), '"variant": "project-eager"'),
                                                Run((*GPU_THROUGHPUT, "reference-eager"),
                                                    '"variant": "reference-eager"')), why=f"compiled variants: {GPU}"),
    "benchmarks/gpu_throughput.sh": Smoke(bash=True, why=GPU),
    "benchmarks/kv_cache_bytes.py": Smoke(runs=(Run(("--context", "1024"), "| deepseek_v3 | 671B |"),)),
    "benchmarks/mla_vs_gqa.py": Smoke(runs=(Run((*ONE_STEP, "--kernels"), "MLA / GQA"),)),
    "benchmarks/moe_grouped_mm.py": Smoke(runs=(Run(("--rounds", "1", "--repeats", "1", "--rows", "64"),
                                                    "debug MoE"),)),
    "benchmarks/moe_step.py": Smoke(runs=(Run(ONE_STEP, "MoE / dense"),)),
    "benchmarks/moe_traffic.py": Smoke(help=True, why="one process per EP rank; its byte counting is "
                                                      "tests/distributed/test_moe_traffic.py's"),
    "benchmarks/muon_gain.py": Smoke(help=True, elsewhere="tests/benchmarks/test_muon_gain.py",
                                    why="six train.py runs of 300 steps (minutes each)"),
    "benchmarks/overhead.py": Smoke(help=True, why=RANKS),
    "benchmarks/plan_by_kind.py": Smoke(help=True, why=DRY_RUN),
    "benchmarks/plan_deepseek_v3.py": Smoke(help=True, why=DRY_RUN),
    "benchmarks/plan_validation.py": Smoke(help=True, why=DRY_RUN),
    "benchmarks/release_round_trip.py": Smoke(runs=(Run(("--tiny", "--layers", "1", "--vocab", "64", "--seq", "8",
                                                         "--releases", "3.2-1B"), "export float32 vs original: 0"),),
                                              help=True),
    "benchmarks/semi_sync_bytes.py": Smoke(help=True, why="two replica groups and a lighthouse per mode"),
    "benchmarks/startup.py": Smoke(help=True, why=RANKS),
    "benchmarks/peer/peer_cpu.py": Smoke(imports=True, why=f"runs in the peer's process: {PEER}"),
    "benchmarks/peer/peer_cpu_assets.py": Smoke(imports=True),
    "benchmarks/peer/peer_cpu_compare.py": Smoke(help=True, elsewhere="tests/benchmarks/test_peer_cpu_compare.py",
                                                 why=PEER),
    "benchmarks/peer/peer_cpu_patches.py": Smoke(imports=True, why=f"loaded in the peer's process: {PEER}"),
    "benchmarks/peer/peer_torchtitan.py": Smoke(help=True, why=PEER),
}
RUNS = [(path, run) for path, smoke in TABLE.items() for run in smoke.runs]


def test_every_benchmark_has_a_smoke_entry():
    assert coverage_problems("benchmarks", TABLE) == []


@pytest.mark.parametrize("path", [p for p, s in TABLE.items() if s.help])
def test_help(path, capsys):
    assert call_main(load(path), ["--help"]) == 0
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("path", [p for p, s in TABLE.items() if s.imports])
def test_imports(path):
    assert load(path).__file__.endswith(path)


@pytest.mark.parametrize("path", [p for p, s in TABLE.items() if s.bash])
def test_shell_script_names_only_existing_files(path):
    from conftest import REPO

    missing = [name for name in named_paths(path) if not (REPO / name).exists()]
    assert missing == [], f"{path} names files that do not exist: {missing}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    return run_all(RUNS, tmp_path_factory.mktemp("benchmark_smoke"))


@pytest.mark.slow  # one process for all the runs
@pytest.mark.parametrize("path, run", RUNS, ids=[run_key(p, r) for p, r in RUNS])
def test_tiny_run(path, run, runs):
    result = runs[run_key(path, run)]
    assert result["status"] == 0 and run.expect in result["output"], result["output"]


@pytest.mark.parametrize("path, argv, expected", [
    ("benchmarks/checkpoint_integrity.py", ["--shapes", "huge"], "--shapes: unknown huge; choose from tiny, debug"),
    ("benchmarks/plan_deepseek_v3.py", ["deepseek_v3_1t", "8"], "deepseek_v3_1t.toml does not exist"),
    ("benchmarks/plan_validation.py", ["8b-fsdp9"], "unknown row(s) 8b-fsdp9; --list names the rows"),
    ("benchmarks/release_round_trip.py", ["--releases", "3.3-1B"], "--releases: unknown 3.3-1B; choose from 3.2-1B"),
])
def test_a_bad_argument_is_refused_in_one_line(path, argv, expected, capsys):
    # On 8ccae30 the shape ran the large model, the config and the row ended in tracebacks (IndexError, KeyError).
    assert call_main(load(path), argv) == 2
    assert expected in capsys.readouterr().err


def test_gpu_moe_summary_reads_the_step_lines_the_trainer_prints(tmp_path):
    # The table's regex against the trainer's own step line: tokens/s of the steps after the third, and the
    # reserved memory of the last one.
    log = tmp_path / "run.log"
    log.write_text("\n".join(f"[rank0] 12:00:0{s} INFO " + format_step_line(s, {"loss": 2.0, "tps": 1000.0 * s,
                                                                                 "max_reserved_gib": 10.0 + s})
                             for s in range(1, 6)))
    assert load("benchmarks/gpu_moe_summary.py").row(log) == "| run | 4,500 | 15.00 | |  |"
