"""scripts/loss_compare.py: table, verdicts, refusals and exit codes, on synthetic dump folders.

Each fake run is what a training run leaves in its dump folder: ``config.toml`` and
TensorBoard events with a ``loss`` scalar per step. One test trains for real (one
process, two steps) to cover the launch path.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from conftest import load_script

loss_compare = load_script("scripts/loss_compare.py")

CONTROL = [8.0, 7.5, 7.0, 6.8, 6.5]


def fake_run(root: Path, name: str, losses: list[float], *, batch_size: int = 1, shard: int = 8,
             replicate: int = 1, seq_len: int = 64, seed: int | None = 42, tb: str = "tb",
             log_line: str | None = None, validation: dict[int, float] | None = None,
             held_out: float = 0.01) -> Path:
    """A dump folder with the effective config and one loss per step (steps 1..len(losses))."""
    from torch.utils.tensorboard import SummaryWriter

    dump = root / name
    dump.mkdir(parents=True)
    seed_line = f"seed = {seed}" if seed is not None else "# seed = unset"
    (dump / "config.toml").write_text(
        f'[model]\nflavor = "debugmodel"\ntokenizer_path = "tok.model"\n'
        f"[optimizer]\nlr = 0.0008\n[lr_scheduler]\nwarmup_steps = 2\n"
        f'[training]\ndataset = "embedded"\nbatch_size = {batch_size}\nseq_len = {seq_len}\n'
        f'global_batch_size = -1\ngradient_accumulation_steps = 1\nmixed_precision_param = "auto"\n{seed_line}\n'
        f"[parallelism]\ndata_parallel_replicate_degree = {replicate}\ndata_parallel_shard_degree = {shard}\n"
        f"tensor_parallel_degree = 1\ncontext_parallel_degree = 1\npipeline_parallel_degree = 1\n"
        f'[metrics]\nsave_tb_folder = "{tb}"\n'
        f"[validation]\nenable = {str(validation is not None).lower()}\nheld_out_fraction = {held_out}\n"
        f"steps = -1\nsplit_seed = 0\n"
    )
    if log_line is not None:
        (dump / "train.log").write_text(f"[rank0] 00:00:00 INFO {log_line}\n")
    writer = SummaryWriter(log_dir=str(dump / tb))
    for step, loss in enumerate(losses, start=1):
        writer.add_scalar("loss", loss, step)
        writer.add_scalar("grad_norm", 1.0, step)
    for step, loss in (validation or {}).items():
        writer.add_scalar("validation/loss", loss, step)
    writer.close()
    return dump


def compare(*dumps: Path, extra: tuple[str, ...] = ()) -> int:
    return loss_compare.main(["--from-logs", *map(str, dumps), *extra])


def test_within_tolerance_prints_table_and_exits_0(tmp_path, capsys):
    control = fake_run(tmp_path, "fsdp", CONTROL)
    # Same global batch (2 x 4 = 8) on another layout, 1e-5 relative off at every step.
    test = fake_run(tmp_path, "hsdp", [x * (1 + 1e-5) for x in CONTROL], batch_size=2, shard=4)
    assert compare(control, test, extra=("--tolerance", "1e-4")) == 0
    out = capsys.readouterr().out
    header, *rows = out.split("\n\n")[0].splitlines()
    assert header.split() == ["step", "fsdp", "hsdp", "rel", "diff"]
    assert [int(r.split()[0]) for r in rows] == [1, 2, 3, 4, 5]
    assert rows[0].split()[1:] == ["8.0000000", "8.0000801", "1.00e-05"]  # float32 storage of 8.00008
    summary = out.split("\n\n")[1]
    assert "hsdp" in summary and "PASS" in summary and "FAIL" not in summary


def test_curve_leaving_the_tolerance_exits_1_and_names_the_step(tmp_path, capsys):
    control = fake_run(tmp_path, "control", CONTROL)
    drifting = [x * (1 + 1e-6 * 10 ** i) for i, x in enumerate(CONTROL)]  # 1e-6 ... 1e-2
    good = fake_run(tmp_path, "good", CONTROL)
    bad = fake_run(tmp_path, "bad", drifting)
    assert compare(control, good, bad, extra=("--tolerance", "1e-4")) == 1
    summary = capsys.readouterr().out.split("\n\n")[1]
    good_line = next(line for line in summary.splitlines() if line.startswith("good"))
    bad_line = next(line for line in summary.splitlines() if line.startswith("bad"))
    assert good_line.split()[-1] == "PASS" and "0.00e+00" in good_line  # bitwise equal curves
    fields = bad_line.split()
    assert fields[3] == "1.00e-02" and fields[4] == "5" and fields[-1] == "FAIL"  # max rel, at step 5


def test_different_global_batch_is_refused(tmp_path, capsys):
    control = fake_run(tmp_path, "control", CONTROL)  # 1 x 8 ranks
    bigger = fake_run(tmp_path, "bigger", CONTROL, batch_size=2)  # 2 x 8 ranks = 16 sequences
    assert compare(control, bigger) == 2
    err = capsys.readouterr().err
    assert "refusing to compare" in err and "global batch 16" in err and "control: 8" in err


def test_different_tokens_per_step_is_refused(tmp_path, capsys):
    control = fake_run(tmp_path, "control", CONTROL)
    longer = fake_run(tmp_path, "longer", CONTROL, seq_len=128)
    assert compare(control, longer) == 2
    assert "1024 tokens/step" in capsys.readouterr().err


def test_batch_read_from_the_log_when_dp_shard_is_left_to_the_launcher(tmp_path, capsys):
    control = fake_run(tmp_path, "control", CONTROL)
    # dp_shard = -1: the config alone cannot tell the dp degree; the trainer's log line can.
    auto = fake_run(tmp_path, "auto", CONTROL, shard=-1, batch_size=2,
                    log_line="Training 5 steps: local batch 2 x seq 64, 1 micro-step(s), dp degree 4")
    assert compare(control, auto) == 0
    no_log = fake_run(tmp_path, "no_log", CONTROL, shard=-1)
    assert compare(control, no_log) == 2
    assert "pass --ngpu" in capsys.readouterr().err
    assert compare(control, no_log, extra=("--ngpu", "8")) == 0  # 1 x (8 ranks / 1) = 8


def test_test_that_stops_early_or_diverges_fails(tmp_path, capsys):
    control = fake_run(tmp_path, "control", CONTROL)
    short = fake_run(tmp_path, "short", CONTROL[:3])
    assert compare(control, short) == 1
    assert "stops before step 4" in capsys.readouterr().out
    nan = fake_run(tmp_path, "nan", [*CONTROL[:4], math.nan])
    assert compare(control, nan) == 1


def test_warns_when_seeds_differ(tmp_path, capsys):
    control = fake_run(tmp_path, "control", CONTROL)
    other = fake_run(tmp_path, "other_seed", CONTROL, seed=7)
    assert compare(control, other) == 0
    assert "warning: other_seed: training.seed = 7, control has 42" in capsys.readouterr().out


def test_missing_events_is_an_error(tmp_path, capsys):
    control = fake_run(tmp_path, "control", CONTROL)
    empty = fake_run(tmp_path, "empty", CONTROL, tb="tb_elsewhere")
    for path in (empty / "tb_elsewhere").iterdir():
        path.unlink()
    assert compare(control, empty) == 2
    assert "no TensorBoard events" in capsys.readouterr().err


@pytest.mark.slow
def test_plot_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    control = fake_run(tmp_path, "control", CONTROL)
    test = fake_run(tmp_path, "test", [x * 1.001 for x in CONTROL])
    png = tmp_path / "out.png"
    assert compare(control, test, extra=("--plot", str(png), "--tolerance", "1e-2")) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


@pytest.mark.slow
def test_runs_jobs_through_the_launcher(tmp_path, capsys):
    """One process, two steps: batch 2 against batch 1 x 2 micro-steps (the same global batch)."""
    rc = loss_compare.main([
        "--steps", "2", "--ngpu", "1", "--output-dir", str(tmp_path), "--tolerance", "1e-5",
        "--control", "--training.batch_size 2 --training.seq_len 32 --job.print_args=false",
        "--test", "--training.batch_size 1 --training.gradient_accumulation_steps 2 --training.seq_len 32 "
                  "--job.print_args=false",
    ])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert (tmp_path / "control" / "train.log").is_file() and (tmp_path / "test1" / "config.toml").is_file()
    assert "test1" in out.split("\n\n")[-1] and "PASS" in out


def test_validation_curves_are_compared_at_the_validation_steps(tmp_path, capsys):
    validation = {2: 7.9, 4: 7.2, 5: 7.0}  # every 2 steps and the last
    control = fake_run(tmp_path, "control", CONTROL, validation=validation)
    close = fake_run(tmp_path, "close", CONTROL, validation={s: v * (1 + 1e-6) for s, v in validation.items()})
    # Same training curve, validation drifting at step 4: only --metric validation/loss sees it.
    drift = fake_run(tmp_path, "drift", CONTROL, validation={**validation, 4: 7.2 * 1.01})
    assert compare(control, close, drift) == 0
    capsys.readouterr()
    assert compare(control, close, drift, extra=("--metric", "validation/loss", "--tolerance", "1e-4")) == 1
    table, summary = capsys.readouterr().out.split("\n\n")[:2]
    assert [int(row.split()[0]) for row in table.splitlines()[1:]] == [2, 4, 5]
    close_line = next(line for line in summary.splitlines() if line.startswith("close"))
    drift_line = next(line for line in summary.splitlines() if line.startswith("drift"))
    assert close_line.split()[1] == "3" and close_line.split()[-1] == "PASS"
    assert drift_line.split()[3] == "1.00e-02" and drift_line.split()[4] == "4" and drift_line.split()[-1] == "FAIL"
    # A test that did not validate cannot be compared; another held-out split is worth a warning.
    silent = fake_run(tmp_path, "silent", CONTROL)
    assert compare(control, silent, extra=("--metric", "validation/loss")) == 2
    assert "no 'validation/loss' scalar (was validation.enable on?)" in capsys.readouterr().err
    other_split = fake_run(tmp_path, "other_split", CONTROL, validation=validation, held_out=0.05)
    assert compare(control, other_split, extra=("--metric", "validation/loss")) == 0
    assert "warning: other_split: validation.held_out_fraction = 0.05, control has 0.01" in capsys.readouterr().out
