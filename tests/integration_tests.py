#!/usr/bin/env python3
"""The integration matrix: every supported layout and feature trained end to end through the launcher.

    python tests/integration_tests.py OUTPUT_DIR [--ngpu 8] [--test A,B] [--exclude C,D] [--list]
        [--config FILE] [--steps N] [--jobs J] [--require-all]

Each *flavor* is a named list of config overrides, run through ``run_llama_train.sh``
(``NGPU``, ``CONFIG_FILE`` and ``LOG_RANK`` set in the environment) with its own dump
folder ``OUTPUT_DIR/<flavor>``. A flavor passes only if, besides exiting 0:

- the per-step losses (read back from TensorBoard) are finite, one per step, and fall;
- rank 0 logs the expected world mesh (``World mesh {...}``, dims in mesh order);
- for parity-eligible flavors, the step-1 loss equals the control's (``fsdp``) to the
  parity tolerance. Initialization is layout-invariant and every flavor trains on the
  same global batch, so the first loss, computed before any update, only differs by
  floating-point summation order (docs/determinism.md);
- its own checks pass (trace files, TensorBoard tags, exact resume, ...).

Bad-config flavors must instead stop quickly with a config error (a rank exits with
status 2, the others exit the same way or are stopped by torchrun), print the expected
``config error:`` line, and never start training.

Flavors needing more ranks than ``--ngpu`` are reported as SKIPPED, never silently, and
``--require-all`` turns that into a failure. The exit status is 1 if any flavor failed.

On a CPU-only machine the default config is ``train_configs/debug_model_ci.toml`` (tiny
sizes for CI); with GPUs it is ``train_configs/debug_model.toml`` with 2048-token
sequences and 20 steps (``--config``, ``--seq-len`` and ``--steps`` change these).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
# The feature probe imports the trainer in-process; the launched runs find it on their own.
sys.path.insert(0, str(REPO))
from torchtitan.distributed.lifecycle import free_port  # noqa: E402  (after the path)

# The trainer's console lines, read with the patterns the package declares next to their formats.
from torchtitan.metrics.logger import MESH_LINE as MESH_RE  # noqa: E402
from torchtitan.metrics.logger import STEP_LINE as STEP_RE  # noqa: E402
from torchtitan.metrics.logger import VALIDATION_LINE as VALIDATION_RE  # noqa: E402

LAUNCHER = REPO / "run_llama_train.sh"
CI_CONFIG = REPO / "train_configs" / "debug_model_ci.toml"
GPU_CONFIG = REPO / "train_configs" / "debug_model.toml"
GPU_STEPS, GPU_SEQ_LEN = 20, 2048

# Every training flavor sees this many sequences per optimizer step (all ranks and
# micro-steps together), so their step-1 losses are comparable with the control's.
GLOBAL_BATCH = 8
CONTROL = "fsdp"

# A curve compared with another over several steps (resume into another layout) drifts by
# float32 summation order, far below this bound (measured: benchmarks/README.md section 12).
CURVE_RTOL_CPU = 1e-5
STEP1_RTOL_CPU = 1e-6  # the step-1 parity tolerance of docs/determinism.md
# bf16 compute: rounding at ~3 significant digits, averaged over the batch's tokens. Not
# measured on GPUs by this project yet; override with --parity-rtol.
STEP1_RTOL_GPU = 1e-3


# ---------------------------------------------------------------------------------------
# Flavors
# ---------------------------------------------------------------------------------------
Mesh = tuple[tuple[str, int], ...]


@dataclasses.dataclass(frozen=True)
class Phase:
    """One launch of the trainer (most flavors have one; checkpoint flavors chain several)."""

    overrides: tuple[str, ...]
    ranks: int
    dp: int = 0  # data-parallel degree (dp_replicate x dp_shard); 0 = ranks. Sets the local batch.
    accum: int = 1  # gradient accumulation steps, for the local batch arithmetic
    mesh: Mesh | None = None  # expected world mesh, in mesh order
    tb_folder: str = "tb"
    multinode: bool = False  # two agents on this host (run_llama_train.sh with NNODES=2), ranks/2 each
    trains: bool = True  # False for a run that only writes something (a seed checkpoint)
    first_step: int = 1  # the first step this phase logs (a resumed run starts later)
    falls: bool = True  # assert that the loss falls (needs a few steps from a fresh start)

    def local_batch(self) -> int:
        per_step = (self.dp or self.ranks) * self.accum
        if GLOBAL_BATCH % per_step:
            raise ValueError(f"global batch {GLOBAL_BATCH} is not a multiple of dp x accum = {per_step}")
        return GLOBAL_BATCH // per_step


@dataclasses.dataclass
class Run:
    """What one phase left behind."""

    phase: Phase
    rc: int
    seconds: float
    log: str
    dump: Path
    losses: dict[int, float] = dataclasses.field(default_factory=dict)  # step -> loss (TensorBoard)
    cpu_seconds: float = 0.0


Check = Callable[[list[Run]], list[str]]  # returns the problems found, empty when fine


@dataclasses.dataclass(frozen=True)
class Flavor:
    name: str
    description: str
    phases: tuple[Phase, ...]
    requires: tuple[str, ...] = ()  # features it exercises (for --list)
    parity_phase: int | None = 0  # phase whose step-1 loss must equal the control's; None = not eligible
    parity_rtol: float | None = None  # None = the device default
    expect_error: str | None = None  # bad config: regex every rank must print, exit 2, fast
    compare: tuple[int, int, float] | None = None  # (phase a, phase b, rtol): equal losses on common steps
    checks: tuple[Check, ...] = ()

    @property
    def ranks(self) -> int:
        return max(p.ranks for p in self.phases)


def _dp(replicate: int = 1, shard: int = 1) -> list[str]:
    return [f"--parallelism.data_parallel_replicate_degree={replicate}",
            f"--parallelism.data_parallel_shard_degree={shard}"]


def _tp(n: int) -> list[str]:
    return [f"--parallelism.tensor_parallel_degree={n}"]


def _cp(n: int) -> list[str]:
    return [f"--parallelism.context_parallel_degree={n}"]


def _pp(n: int, schedule: str) -> list[str]:
    return [f"--parallelism.pipeline_parallel_degree={n}", f"--parallelism.pipeline_parallel_schedule={schedule}"]


_MOE = ("--model.name=qwen3", "--model.flavor=debugmodel_moe")


def _phase(ranks: int, dp: int, mesh: dict[str, int], *overrides: str, **kw) -> Phase:
    return Phase(tuple(overrides), ranks, dp=dp, mesh=tuple(mesh.items()), **kw)


# ---- flavor-specific checks ---------------------------------------------------------------
def _log_contains(pattern: str, phase: int = 0) -> Check:
    def check(runs: list[Run]) -> list[str]:
        return [] if re.search(pattern, runs[phase].log) else [f"log does not match /{pattern}/"]
    return check


# A warning in a run's output: Python's (``UserWarning: ...``), torch's C++/logger ones (``[rank0]:W1127 ...``,
# ``W1127 ...``) and the project's own (`` WARNING ``). A clean run prints none.
WARNING_LINE = re.compile(r"^.*(?:Warning: |^(?:\[rank\d+\]:)?W\d{4} | WARNING ).*$", re.M)


def _no_warnings(runs: list[Run]) -> list[str]:
    """No phase printed a warning (a warning names something the project should fix or show harmless)."""
    found = [line for run in runs for line in WARNING_LINE.findall(run.log)]
    return [f"{len(found)} warning line(s), the first: {found[0][:300]}"] if found else []


def _tensorboard_matches_log(runs: list[Run]) -> list[str]:
    """TensorBoard holds the metrics of every step, and its losses are the ones rank 0 logged."""
    run, problems = runs[0], []
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run.dump / run.phase.tb_folder), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    missing = {"loss", "grad_norm", "lr"} - tags
    if missing:
        problems.append(f"TensorBoard lacks {sorted(missing)} (has {sorted(tags)})")
    logged = {int(s): float(v) for r, s, v in STEP_RE.findall(run.log) if r == "0"}
    if sorted(logged) != sorted(run.losses):
        problems.append(f"steps logged {sorted(logged)} != steps in TensorBoard {sorted(run.losses)}")
    for step, value in logged.items():
        # The log prints 4 decimals; TensorBoard keeps float32.
        if step in run.losses and abs(run.losses[step] - value) > 6e-5:
            problems.append(f"step {step}: TensorBoard loss {run.losses[step]} != logged {value}")
    return problems


def _profile_traces(step: int) -> Check:
    def check(runs: list[Run]) -> list[str]:
        run = runs[0]
        folder = run.dump / "profile_traces" / f"iteration_{step}"
        problems = []
        for rank in range(run.phase.ranks):
            trace = folder / f"rank{rank}_trace.json"
            if not trace.is_file():
                problems.append(f"missing {trace.relative_to(run.dump)}")
            elif '"traceEvents"' not in trace.read_text(errors="replace")[:100_000]:
                problems.append(f"{trace.relative_to(run.dump)} is not a Chrome trace")
        return problems
    return check


def _both_agents_ran(runs: list[Run]) -> list[str]:
    """Each torchrun agent hosted half the ranks: global ranks 0 and ranks/2 are the agents' local rank 0."""
    run = runs[0]
    seen = {int(r) for r, _ in MESH_RE.findall(run.log)}
    want = {0, run.phase.ranks // 2}
    return [] if seen == want else [f"expected mesh lines from global ranks {sorted(want)} (one per agent), got "
                                    f"{sorted(seen)}"]


def _resumed_from(step: int, phase: int) -> Check:
    """The resumed phase logged its first step right after the checkpoint, not step 1."""
    def check(runs: list[Run]) -> list[str]:
        steps = sorted(runs[phase].losses)
        return [] if steps and steps[0] == step + 1 else [f"phase {phase + 1} should resume at step {step + 1}, "
                                                          f"its first logged step is {steps[:1]}"]
    return check


def _validation_logged(freq: int) -> Check:
    """Validation ran every ``freq`` steps and at the last; TensorBoard holds what rank 0 logged."""
    def check(runs: list[Run]) -> list[str]:
        run = runs[0]
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(run.dump / run.phase.tb_folder), size_guidance={"scalars": 0})
        acc.Reload()
        tags = set(acc.Tags()["scalars"])
        want_tags = {"validation/loss", "validation/perplexity", "validation/tokens", "validation/train_tokens_seen"}
        if not want_tags <= tags:
            return [f"TensorBoard lacks {sorted(want_tags - tags)}"]
        loss = {e.step: e.value for e in acc.Scalars("validation/loss")}
        ppl = {e.step: e.value for e in acc.Scalars("validation/perplexity")}
        last = max(run.losses)
        want = [s for s in range(1, last + 1) if s % freq == 0 or s == last]
        logged = {int(s): float(v) for r, s, v in VALIDATION_RE.findall(run.log) if r == "0"}
        problems = []
        if sorted(loss) != want or sorted(logged) != want:
            problems.append(f"validated at steps {sorted(loss)} (TensorBoard), {sorted(logged)} (log); expected {want}")
        for step, value in loss.items():
            if not (math.isfinite(value) and value > 0) or abs(ppl[step] - math.exp(value)) > 1e-4 * ppl[step]:
                problems.append(f"step {step}: validation loss {value}, perplexity {ppl[step]}")
            if step in logged and abs(logged[step] - value) > 1e-3:
                problems.append(f"step {step}: TensorBoard validation loss {value} != logged {logged[step]}")
        return problems
    return check


CKPT = ("--checkpoint.enable_checkpoint",)


def build_flavors() -> list[Flavor]:
    ac_full = "--activation_checkpoint.mode=full"
    ac_sel = "--activation_checkpoint.mode=selective"
    f = Flavor
    flavors = [
        # ---- data parallel (the control and its relatives) ----
        f(CONTROL, "FSDP 8 (the control every parity-eligible flavor is compared with)",
          (_phase(8, 8, {"dp_shard": 8}, *_dp(1, 8)),)),
        # HSDP 2x4 trains against one process in tests/distributed/test_layout_parity.py; 2x2 on 4 ranks here.
        f("hsdp", "HSDP 2x2: shard within 2 ranks, replicate across 2",
          (_phase(4, 4, {"dp_replicate": 2, "dp_shard": 2}, *_dp(2, 2)),)),
        # DDP 8 trains against one process in tests/distributed/test_layout_parity.py; 4 ranks here.
        f("ddp", "DDP 4: FSDP2 on a (dp_replicate=4, dp_shard=1) mesh",
          (_phase(4, 4, {"dp_replicate": 4}, *_dp(4, 1)),)),
        f("fsdp_full_ac", "FSDP 4 + full activation checkpointing",
          (_phase(4, 4, {"dp_shard": 4}, *_dp(1, 4), ac_full),)),
        f("fsdp_selective_ac_layer", "FSDP 2 + selective AC, every 2nd block",
          (_phase(2, 2, {"dp_shard": 2}, *_dp(1, 2), ac_sel, "--activation_checkpoint.selective_ac_option=2"),)),
        f("fsdp_selective_ac_op", "FSDP 2 + selective AC, op policy (every second linear output and attention kept)",
          (_phase(2, 2, {"dp_shard": 2}, *_dp(1, 2), ac_sel, "--activation_checkpoint.selective_ac_option=op"),)),
        # Inductor fuses and reorders float32 ops: equal to rounding, not bitwise (tests/test_trainer.py).
        f("fsdp_compile", "FSDP 2 + torch.compile of each block (one compile flavor: slow on CPU)",
          (_phase(2, 2, {"dp_shard": 2}, *_dp(1, 2), "--training.compile"),), parity_rtol=1e-4),
        f("grad_accum", "FSDP 4, local batch 1 x 2 micro-steps (global batch unchanged)",
          (_phase(4, 4, {"dp_shard": 4}, *_dp(1, 4), "--training.gradient_accumulation_steps=2", accum=2),),
          checks=(_log_contains(r"2 micro-step\(s\)"),)),
        f("tensorboard", "FSDP 2, TensorBoard into a custom folder: every metric of every step, same as the log",
          (_phase(2, 2, {"dp_shard": 2}, *_dp(1, 2), "--metrics.save_tb_folder=tb_custom", tb_folder="tb_custom"),),
          checks=(_tensorboard_matches_log,)),
        f("profiling", "FSDP 2 + torch.profiler: a Chrome trace per rank at step 2",
          (_phase(2, 2, {"dp_shard": 2}, *_dp(1, 2), "--profiling.enable_profiling",
                  "--profiling.profile_freq=2"),),
          checks=(_profile_traces(2),)),
        # tests/test_multinode.py also trains two agents bitwise against one, in two network namespaces.
        f("multinode", "HSDP 2x2 over two launcher agents on this host (NNODES=2, c10d rendezvous), 2 ranks each",
          (_phase(4, 4, {"dp_replicate": 2, "dp_shard": 2}, *_dp(2, 2), multinode=True),),
          checks=(_both_agents_ran,)),
        # ---- tensor and context parallel ----
        # tests/distributed/test_tp_cp_layouts.py trains the 8-rank shapes (FSDP 4 x TP 2, TP 2 without SP,
        # FSDP 4 x CP 2, HSDP x CP, ...) against a control; the matrix trains the smallest shape of each
        # composition through the launcher.
        f("fsdp_tp", "FSDP 2 x TP 2 (sequence parallel, loss parallel)",
          (_phase(4, 2, {"dp_shard": 2, "tp": 2}, *_dp(1, 2), *_tp(2)),), requires=("tp",)),
        # tests/optim/test_muon_owners.py checks the owner update against one process in seven layouts.
        # tests/optim/test_qk_clip_layouts.py checks the clip against one process on TP 2 x FSDP 2.
        f("muon_fsdp_tp", "MuonClip, FSDP 2 x TP 2: each matrix orthogonalized by one owner rank, QK-clip logged",
          (_phase(4, 2, {"dp_shard": 2, "tp": 2}, *_dp(1, 2), *_tp(2), "--optimizer.name=MuonClip"),),
          requires=("tp",), checks=(_log_contains(r"Muon on \d+ matrices \(each orthogonalized by one owner rank\)"),
                                    _log_contains(r"max_logit: \d"))),
        f("tp2_no_sp", "TP 2 without sequence parallel", (_phase(
            2, 1, {"tp": 2}, *_dp(1, 1), *_tp(2), "--parallelism.enable_sequence_parallel=false"),),
          requires=("tp",)),
        f("tp2_no_loss_parallel", "TP 2 with logits gathered before the loss", (_phase(
            2, 1, {"tp": 2}, *_dp(1, 1), *_tp(2), "--parallelism.disable_loss_parallel"),), requires=("tp",)),
        # HSDP 2x2 x TP 2 trains in test_tp_cp_layouts.py; replicate 2 x TP 2 on 4 ranks here.
        f("hsdp_tp", "HSDP 2x1 x TP 2 (replicated over 2, each replica split over TP 2)",
          (_phase(4, 2, {"dp_replicate": 2, "tp": 2}, *_dp(2, 1), *_tp(2)),), requires=("tp",)),
        f("cp2", "CP 2 alone (the sequence split over 2 ranks, load-balanced)",
          (_phase(2, 1, {"cp": 2}, *_dp(1, 1), *_cp(2)),), requires=("cp",)),
        f("fsdp_cp", "FSDP 2 x CP 2", (_phase(4, 2, {"dp_shard": 2, "cp": 2}, *_dp(1, 2), *_cp(2)),),
          requires=("cp",)),
        f("fsdp_tp_cp", "FSDP 2 x TP 2 x CP 2",
          (_phase(8, 2, {"dp_shard": 2, "cp": 2, "tp": 2}, *_dp(1, 2), *_tp(2), *_cp(2)),), requires=("tp", "cp")),
        # ---- pipeline parallel (tests/distributed/test_pipeline_parallel.py trains PP 2 x FSDP 4,
        # PP 2 x HSDP, PP 2 x TP 2 x FSDP 2 and PP 2 x TP 2 x CP 2 against a control) ----
        f("pp_1f1b", "PP 2, 1F1B", (_phase(2, 1, {"pp": 2}, *_dp(1, 1), *_pp(2, "1F1B")),), requires=("pp",)),
        f("pp_gpipe", "PP 2, GPipe", (_phase(2, 1, {"pp": 2}, *_dp(1, 1), *_pp(2, "GPipe")),), requires=("pp",)),
        f("pp_interleaved_1f1b", "PP 2, Interleaved1F1B (2 stages per rank)",
          (_phase(2, 1, {"pp": 2}, *_dp(1, 1), *_pp(2, "Interleaved1F1B")),), requires=("pp",)),
        f("pp_tp", "PP 2 x TP 2", (_phase(4, 1, {"pp": 2, "tp": 2}, *_dp(1, 1), *_pp(2, "1F1B"), *_tp(2)),),
          requires=("pp", "tp")),
        f("pp_tp_fsdp", "PP 2 x FSDP 2 x TP 2 (3-D)",
          (_phase(8, 2, {"pp": 2, "dp_shard": 2, "tp": 2}, *_dp(1, 2), *_pp(2, "1F1B"), *_tp(2)),),
          requires=("pp", "tp")),
        # ---- mixture of experts (tests/distributed/test_moe_layouts.py trains the 8-rank EP layouts with TP, CP,
        # PP and HSDP against one process; the matrix trains EP through train.py, compiled, and refuses a bad EP) ----
        # Another model than the control's: no step-1 parity; the loss must fall and the MoE metrics show.
        f("moe_ep_fsdp", "Qwen3-MoE debug: EP 2 on FSDP 2 (one efsdp rank), routing bias, switch auxiliary loss, "
          "torch.compile (attention compiled, MoE eager)",
          (_phase(2, 2, {"dp_shard": 2}, *_dp(1, 2), *_MOE, "--parallelism.expert_parallel_degree=2",
                  "--moe.aux_loss=switch", "--moe.load_balance_coeff=0.001", "--training.compile"),),
          requires=("moe",), parity_phase=None, checks=(_log_contains(r"moe: imbalance [0-9.]+ \(max"), _no_warnings)),
        f("moe_bad_ep", "EP 3 does not divide the 8 experts: one config error on every rank",
          (_phase(6, 6, {"dp_shard": 6}, *_dp(1, 6), *_MOE, "--parallelism.expert_parallel_degree=3"),),
          parity_phase=None, expect_error=r"--parallelism.expert_parallel_degree=3 does not divide the 8 experts"),
        # ---- validation ----
        # Holding documents out changes the training data, so no step-1 parity with the control. Layout
        # invariance of the validation loss is tested in tests/distributed/ (FSDP, HSDP, DDP, TP, CP, PP).
        f("validation", "PP 2 (1F1B), 10% of the documents held out, validated every 4 steps and at the last",
          (_phase(2, 1, {"pp": 2}, *_dp(1, 1), *_pp(2, "1F1B"), "--validation.enable",
                  "--validation.held_out_fraction=0.1", "--validation.freq=4", "--validation.steps=2"),),
          requires=("pp",), parity_phase=None, checks=(_validation_logged(4),)),
        # ---- checkpointing ----
        # Train 6 steps saving at 3 and 6, then restart from step 3: steps 4-6 must repeat bitwise.
        f("ckpt_resume", "FSDP 4: train 6 steps (save at 3), resume from step 3, steps 4-6 bitwise equal",
          (_phase(4, 4, {"dp_shard": 4}, *_dp(1, 4), *CKPT, "--checkpoint.interval=3"),
           _phase(4, 4, {"dp_shard": 4}, *_dp(1, 4), *CKPT, "--checkpoint.interval=3", "--checkpoint.load_step=3",
                  "--metrics.save_tb_folder=tb_resume", tb_folder="tb_resume", first_step=4, falls=False)),
          requires=("checkpoint",), compare=(0, 1, 0.0), checks=(_resumed_from(3, 1),)),
        # Another seed in the second phase: had it not loaded the checkpoint, its weights would differ.
        f("ckpt_reshard", "save under FSDP 4, resume from step 3 under FSDP 2 x TP 2 (another seed)",
          (_phase(4, 4, {"dp_shard": 4}, *_dp(1, 4), *CKPT, "--checkpoint.interval=3"),
           _phase(4, 2, {"dp_shard": 2, "tp": 2}, *_dp(1, 2), *_tp(2), *CKPT, "--checkpoint.interval=3",
                  "--checkpoint.load_step=3", "--training.seed=7", "--metrics.save_tb_folder=tb_resume",
                  tb_folder="tb_resume", first_step=4, falls=False)),
          requires=("checkpoint", "tp"), compare=(0, 1, CURVE_RTOL_CPU), checks=(_resumed_from(3, 1),)),
        f("seed_ckpt", "seed checkpoint on 1 process, then FSDP 2 x TP 2 from it (another seed): control's loss",
          (Phase(("--checkpoint.enable_checkpoint", "--checkpoint.create_seed_checkpoint"), 1, trains=False),
           _phase(4, 2, {"dp_shard": 2, "tp": 2}, *_dp(1, 2), *_tp(2), *CKPT, "--training.seed=7")),
          requires=("checkpoint", "tp"), parity_phase=1),
        # ---- bad configs: exit 2 on every rank before any collective (with moe_bad_ep above); each costs one
        # preflight, no rank ----
        f("bad_degrees", "dp_shard 3 on 4 ranks",
          (Phase(("--parallelism.data_parallel_shard_degree=3",), 4),), parity_phase=None,
          expect_error=r"config error: --parallelism\.data_parallel_shard_degree=3 = 3, but world_size=4"),
        f("bad_option_name", "a misspelt option gets a suggestion",
          (Phase(("--parallelism.tensor_paralel_degree=2",), 2),), parity_phase=None,
          expect_error=r"config error: unknown option --parallelism\.tensor_paralel_degree; "
                       r"did you mean 'parallelism\.tensor_parallel_degree'\?"),
        f("bad_global_batch", "global batch 6 on 4 data-parallel ranks",
          (Phase(("--training.global_batch_size=6", "--training.batch_size=1"), 4),), parity_phase=None,
          expect_error=r"config error: --training\.global_batch_size=6 is not a multiple of"),
        f("bad_tp_heads", "TP 3 does not divide the debug model's 16 heads",
          (Phase((*_tp(3),), 3),), parity_phase=None, requires=("tp",),
          expect_error=r"config error: .*(head|divisible)"),
        f("bad_pp_schedule", "an unknown pipeline schedule lists the choices",
          (Phase((*_pp(2, "OneFOneB"),), 2),), parity_phase=None, requires=("pp",),
          expect_error=r"config error: .*OneFOneB.*1F1B"),
    ]
    names = [fl.name for fl in flavors]
    assert len(names) == len(set(names)), "flavor names must be unique"
    return flavors


# ---------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class Result:
    flavor: Flavor
    status: str = "PENDING"  # PASS, FAIL, SKIPPED
    seconds: float = 0.0
    runs: list[Run] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)
    reason: str = ""  # why SKIPPED

    @property
    def cpu_seconds(self) -> float:
        return sum(r.cpu_seconds for r in self.runs)

    @property
    def final_loss(self) -> float | None:
        for run in reversed(self.runs):
            if run.losses:
                return run.losses[max(run.losses)]
        return None


def read_losses(tb_dir: Path) -> dict[int, float]:
    """step -> loss from the TensorBoard events under ``tb_dir`` (empty if there are none)."""
    if not tb_dir.is_dir() or not any(tb_dir.glob("**/events.out.tfevents.*")):
        return {}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    if "loss" not in acc.Tags()["scalars"]:
        return {}
    return {e.step: float(e.value) for e in acc.Scalars("loss")}


class Matrix:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.out = Path(args.output_dir).resolve()
        self.cuda = _cuda_count() > 0

    # ---- command lines ----
    def phase_args(self, flavor: Flavor, phase: Phase, dump: Path) -> list[str]:
        args = [f"--job.dump_folder={dump}"]
        if flavor.expect_error is None:
            # Losses are read back from TensorBoard at every step, whatever the config says.
            args += ["--metrics.enable_tensorboard", "--metrics.log_freq=1",
                     f"--training.batch_size={phase.local_batch()}"]
            if self.args.steps:
                args.append(f"--training.steps={self.args.steps}")
            if self.args.seq_len:
                args.append(f"--training.seq_len={self.args.seq_len}")
        return args + list(phase.overrides)

    def run_phase(self, flavor: Flavor, phase: Phase, index: int, devices: list[int]) -> Run:
        dump = self.out / flavor.name
        log_path = dump / f"phase{index + 1}.log"
        dump.mkdir(parents=True, exist_ok=True)
        argv = self.phase_args(flavor, phase, dump)
        env = {**os.environ, "CONFIG_FILE": str(self.args.config), "OMP_NUM_THREADS": os.environ.get(
            "OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1",
               # The launcher's own config check is what bad-config flavors test; for the sound ones it
               # would only repeat every rank's check at the cost of one more Python start per launch.
               "LAUNCH_PREFLIGHT": "1" if flavor.expect_error else "0"}
        if self.cuda:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices))
        # Bad configs show every rank: the message may come from whichever rank gets there first.
        log_rank = ",".join(map(str, range(phase.ranks))) if flavor.expect_error else "0"
        limit = self.args.fail_fast_s if flavor.expect_error else self.args.timeout
        if phase.multinode:
            cmds = self._multinode_commands(flavor, phase, argv)
        else:
            cmds = [["bash", str(LAUNCHER), *argv]]
            env.update(NGPU=str(phase.ranks), LOG_RANK=log_rank)
        start = time.monotonic()
        with open(log_path, "w") as log:
            log.write(f"# {' '.join(cmds[0])}\n")
            log.flush()
            # Own session per agent: on timeout the whole process tree is killed, nothing is left behind.
            procs = [subprocess.Popen(c, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True) for c in cmds]
            rc, cpu = 0, 0.0
            for p in procs:
                code, used = _wait(p, start + limit)
                if code is None:
                    for q in procs:
                        _kill_tree(q)
                    code = 124
                rc, cpu = rc or code, cpu + used
        seconds = time.monotonic() - start
        text = log_path.read_text(errors="replace")
        if rc == 124:
            text += f"\n# integration_tests: killed after {limit:.0f} s\n"
        run = Run(phase, rc, seconds, text, dump, cpu_seconds=cpu)
        if phase.trains and flavor.expect_error is None:
            run.losses = read_losses(dump / phase.tb_folder)
        return run

    def _multinode_commands(self, flavor: Flavor, phase: Phase, argv: list[str]) -> list[list[str]]:
        """Two agents through the launcher's multi-node mode (c10d rendezvous on this host)."""
        port = free_port()
        common = [f"NGPU={phase.ranks // 2}", "NNODES=2", "MASTER_ADDR=127.0.0.1", f"MASTER_PORT={port}",
                  f"RDZV_ID=itest-{flavor.name}-{port}", "LOG_RANK=0"]  # local rank 0 of each agent
        return [["env", *common, f"NODE_RANK={node}", "bash", str(LAUNCHER), *argv] for node in (0, 1)]

    # ---- one flavor ----
    def run_flavor(self, flavor: Flavor, result: Result, devices: list[int]) -> None:
        dump = self.out / flavor.name
        if dump.exists():
            shutil.rmtree(dump)  # stale events or checkpoints from an earlier matrix would be read back
        start = time.monotonic()
        for i, phase in enumerate(flavor.phases):
            run = self.run_phase(flavor, phase, i, devices)
            result.runs.append(run)
            if flavor.expect_error:
                result.problems += check_bad_config(flavor, run, self.args.fail_fast_s)
            else:
                result.problems += check_run(run, self.args.steps)
            if result.problems:
                break  # later phases depend on this one
        result.seconds = time.monotonic() - start
        if not result.problems:
            if flavor.compare:
                a, b, rtol = flavor.compare
                rtol = rtol if not self.cuda else max(rtol, self.step1_rtol(flavor))
                result.problems += compare_curves(result.runs[a], result.runs[b], rtol)
            for check in flavor.checks:
                try:
                    result.problems += check(result.runs)
                except Exception as e:  # noqa: BLE001 - a crashing check is a failed check
                    result.problems.append(f"check {getattr(check, '__name__', check)} raised {e!r}")

    def step1_rtol(self, flavor: Flavor) -> float:
        if self.args.parity_rtol is not None:
            return self.args.parity_rtol
        base = STEP1_RTOL_GPU if self.cuda else STEP1_RTOL_CPU
        return max(base, flavor.parity_rtol or 0.0)


def _cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no usable torch means no GPUs for this purpose
        return 0


def _wait(proc: subprocess.Popen, deadline: float) -> tuple[int | None, float]:
    """(exit status or None at the deadline, CPU seconds of the launcher and every rank it reaped).

    The CPU time measures a flavor's cost independently of how busy the machine is: on a
    shared machine the wall time says more about the neighbours than about the flavor.
    """
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, usage.ru_utime + usage.ru_stime
        if time.monotonic() > deadline:
            return None, 0.0
        time.sleep(0.2)


def _kill_tree(proc: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the session this script started for the launcher
    except ProcessLookupError:
        pass
    proc.wait()


def config_steps(dump: Path) -> int | None:
    """training.steps from the effective config rank 0 wrote into the dump folder."""
    path = dump / "config.toml"
    if not path.is_file():
        return None
    return int(tomllib.loads(path.read_text())["training"]["steps"])


def _failure_excerpt(log: str) -> str:
    """The trainer's own error (torchrun's summary after it says only which rank failed), else the tail."""
    lines = log.splitlines()
    errors = [i for i, line in enumerate(lines)
              if re.match(r"(\[rank\d+\]:?\s*)?[\w.]*(Error|Exception)\b", line) and "ChildFailedError" not in line]
    picked = [lines[i] for i in errors[:3]]
    failed = [line for line in lines if "Training failed" in line or "config error:" in line][:3]
    excerpt = failed + picked
    return "\n".join(excerpt) if excerpt else "last lines:\n" + "\n".join(lines[-15:])


def check_run(run: Run, steps_override: int | None) -> list[str]:
    """The generic assertions for a training phase; returns the problems found."""
    if run.rc != 0:
        return [f"exit status {run.rc} after {run.seconds:.0f} s:\n{_failure_excerpt(run.log)}"]
    phase, problems = run.phase, []
    meshes = [ast.literal_eval(m) for r, m in MESH_RE.findall(run.log) if r == "0"]
    if phase.mesh is not None:
        want = list(phase.mesh)
        if not meshes:
            problems.append("no 'World mesh' line from rank 0")
        elif [list(m.items()) for m in meshes] != [want]:
            problems.append(f"world mesh {meshes} != expected {dict(want)} (in mesh order)")
    if not phase.trains:
        return problems
    steps = steps_override or config_steps(run.dump)
    if steps is None:
        return problems + ["no config.toml in the dump folder"]
    want_steps = list(range(phase.first_step, steps + 1))
    if sorted(run.losses) != want_steps:
        problems.append(f"TensorBoard has losses for steps {sorted(run.losses)}, expected {want_steps}")
        return problems
    curve = [run.losses[s] for s in want_steps]
    if not all(math.isfinite(x) for x in curve):
        problems.append(f"non-finite loss: {curve}")
    elif phase.falls:
        # Noisy per-batch losses: compare the mean of the last two steps with step 1, and
        # ask for a real drop (1 %), not a rounding-level one.
        tail = sum(curve[-2:]) / len(curve[-2:])
        if len(curve) < 3 or not tail < curve[0] * 0.99:
            problems.append(f"loss does not fall: {[round(x, 4) for x in curve]}")
    return problems


def _config_error_exit(run: Run) -> bool:
    """A rank exited with status 2 (config error). torchrun itself then exits 1 and lists the child's code."""
    return run.rc == 2 or (run.rc != 0 and re.search(r"exitcode\s*:\s*2\b", run.log) is not None)


def check_bad_config(flavor: Flavor, run: Run, fail_fast_s: float) -> list[str]:
    """Exit soon, with a config error and the expected message, without training or a traceback.

    torchrun stops the other ranks (SIGTERM) as soon as one exits, so not every rank gets to
    print its line; what must hold is that no rank failed any other way.
    """
    if run.rc == 124:
        return [f"did not exit within {fail_fast_s:.0f} s (a rank waiting on a collective?)"]
    problems = []
    if not _config_error_exit(run):
        problems.append(f"exit status {run.rc} and no rank exited with 2 (config error)")
    codes = {int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", run.log)}
    if codes - {2, -15}:
        problems.append(f"ranks exited with {sorted(codes)}; only 2 (config error) or -15 (stopped by torchrun) "
                        "are expected")
    if not re.search(flavor.expect_error or "", run.log):
        problems.append(f"no line matches /{flavor.expect_error}/; last lines:\n"
                        + "\n".join(run.log.splitlines()[-15:]))
    if STEP_RE.search(run.log):
        problems.append("training started despite the config error")
    # torchrun's own ChildFailedError traceback is expected; one through the trainer is not.
    if re.search(r'File ".*(train\.py|torchtitan/)', run.log):
        problems.append("a traceback through the trainer instead of a clean config error")
    return problems


def compare_curves(a: Run, b: Run, rtol: float) -> list[str]:
    common = sorted(set(a.losses) & set(b.losses))
    if not common:
        return [f"no common steps to compare ({sorted(a.losses)} vs {sorted(b.losses)})"]
    bad = [f"step {s}: {a.losses[s]!r} vs {b.losses[s]!r}" for s in common
           if abs(a.losses[s] - b.losses[s]) > rtol * abs(a.losses[s])]
    return [f"losses differ beyond rel {rtol:g}: " + "; ".join(bad)] if bad else []


# ---------------------------------------------------------------------------------------
# Scheduling and the summary
# ---------------------------------------------------------------------------------------
def run_matrix(matrix: Matrix, flavors: list[Flavor], results: dict[str, Result], jobs: int) -> None:
    """Run ``flavors`` in order, up to ``jobs`` at a time while their ranks fit in ``--ngpu``."""
    free = list(range(matrix.args.ngpu))  # device slots (GPU indices; plain counters on CPU)
    pending = list(flavors)
    running: dict[str, threading.Thread] = {}
    cond = threading.Condition()

    def work(flavor: Flavor, devices: list[int]) -> None:
        result = results[flavor.name]
        try:
            matrix.run_flavor(flavor, result, devices)
        except Exception as e:  # noqa: BLE001 - report, keep the matrix going
            result.problems.append(f"runner error: {e!r}")
        result.status = "FAIL" if result.problems else "PASS"
        _print_result(result)
        with cond:
            free.extend(devices)
            del running[flavor.name]
            cond.notify_all()

    with cond:
        while pending or running:
            startable = next((fl for fl in pending if fl.ranks <= len(free) and len(running) < jobs), None)
            if startable is None:
                cond.wait()
                continue
            pending.remove(startable)
            devices = [free.pop(0) for _ in range(startable.ranks)]
            print(f"[start] {startable.name} ({startable.ranks} ranks): {startable.description}", flush=True)
            thread = threading.Thread(target=work, args=(startable, devices), daemon=True)
            running[startable.name] = thread
            thread.start()


def _print_result(result: Result) -> None:
    line = f"[{result.status.lower()}] {result.flavor.name} ({result.seconds:.0f} s)"
    if result.reason:
        line += f": {result.reason}"
    print(line, flush=True)
    for problem in result.problems:
        print("    " + problem.replace("\n", "\n    "), flush=True)


def check_parity(matrix: Matrix, results: dict[str, Result]) -> None:
    control = results.get(CONTROL)
    control_loss = None
    if control is not None and control.status == "PASS":
        control_loss = control.runs[0].losses.get(1)
    for result in results.values():
        flavor = result.flavor
        if flavor.parity_phase is None or result.status != "PASS" or flavor.name == CONTROL:
            continue
        if control_loss is None:
            result.problems.append(f"parity not checked: the control '{CONTROL}' did not pass")
            result.status = "FAIL"
            continue
        loss = result.runs[flavor.parity_phase].losses.get(1)
        rtol = matrix.step1_rtol(flavor)
        rel = abs(loss - control_loss) / abs(control_loss) if loss is not None else math.inf
        if not rel <= rtol:
            result.problems.append(f"step-1 loss {loss!r} vs control {control_loss!r}: rel {rel:.2e} > {rtol:g}")
            result.status = "FAIL"


def print_summary(results: list[Result], wall: float) -> None:
    print()
    print(f"{'flavor':<24} {'ranks':>5} {'seconds':>8} {'cpu s':>6} {'final loss':>11}  result")
    for r in results:
        loss = f"{r.final_loss:.5f}" if r.final_loss is not None else "-"
        secs = f"{r.seconds:.0f}" if r.runs else "-"
        cpu = f"{r.cpu_seconds:.0f}" if r.runs else "-"
        print(f"{r.flavor.name:<24} {r.flavor.ranks:>5} {secs:>8} {cpu:>6} {loss:>11}  {r.status}"
              + (f" ({r.reason})" if r.reason else ""))
    counts = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIPPED")}
    cpu = sum(r.cpu_seconds for r in results)
    print(f"\n{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIPPED']} skipped; {wall:.0f} s wall, "
          f"{cpu:.0f} CPU s")
    for r in results:
        if r.status == "FAIL":
            print(f"\nFAIL {r.flavor.name} (logs in the dump folder):")
            for problem in r.problems:
                print("    " + problem.replace("\n", "\n    "))


def select(flavors: list[Flavor], test: str | None, exclude: str | None) -> list[Flavor]:
    by_name = {f.name: f for f in flavors}
    wanted = [n for n in (test or "").split(",") if n]
    dropped = [n for n in (exclude or "").split(",") if n]
    unknown = [n for n in wanted + dropped if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown flavor(s) {unknown}; --list shows them")
    chosen = [by_name[n] for n in wanted] if wanted else list(flavors)
    return [f for f in chosen if f.name not in dropped]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("output_dir", nargs="?", default=str(REPO / "outputs" / "integration"),
                   help="each flavor writes OUTPUT_DIR/<flavor> (emptied first)")
    p.add_argument("--ngpu", type=int, default=8, help="ranks (devices) available; larger flavors are skipped")
    p.add_argument("--test", help="comma-separated flavors to run (default: all)")
    p.add_argument("--exclude", help="comma-separated flavors not to run (the control still runs when a chosen "
                                     "flavor's step-1 parity needs it)")
    p.add_argument("--list", action="store_true", help="list the flavors and whether each can run here, then exit")
    p.add_argument("--config", type=Path, help="TOML config (default: the CI config on CPU, debug_model.toml on GPU)")
    p.add_argument("--steps", type=int, help="training steps per run (default: the config's on CPU, 20 on GPUs)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the config's on CPU, 2048 on GPUs)")
    p.add_argument("--jobs", type=int,
                   help="flavors run side by side when their ranks fit in --ngpu (default: 1 on CPU, where it "
                        "does not pay on a small machine; as many as fit on GPUs)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run before it is killed")
    p.add_argument("--fail-fast-s", type=float, default=120, help="seconds a bad-config flavor may take to exit")
    p.add_argument("--parity-rtol", type=float, help="step-1 parity tolerance (default: 1e-6 on CPU, 1e-3 on GPU)")
    p.add_argument("--require-all", action="store_true",
                   help="skipped flavors count as failures")
    args = p.parse_args(argv)
    cuda = _cuda_count() > 0
    if args.config is None:
        args.config = GPU_CONFIG if cuda else CI_CONFIG
    if cuda:
        # Real sizes where they are cheap: the debug model at a production sequence length.
        args.steps = args.steps or GPU_STEPS
        args.seq_len = args.seq_len or GPU_SEQ_LEN
    args.config = args.config.resolve()
    if args.jobs is None:
        args.jobs = args.ngpu if cuda else 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    flavors = build_flavors()
    chosen = select(flavors, args.test, args.exclude)
    if args.list:
        for f in chosen:
            state = f"skipped: needs {f.ranks} ranks" if f.ranks > args.ngpu else "runs"
            print(f"{f.name:<24} {f.ranks:>2} ranks  {f.description}  [{state}]")
        return 0
    # Parity needs the control's step-1 loss: run it first, even when not asked for.
    if any(f.parity_phase is not None for f in chosen) and CONTROL not in {f.name for f in chosen}:
        print(f"note: running the control '{CONTROL}' too, for the step-1 parity checks")
        chosen.insert(0, next(f for f in flavors if f.name == CONTROL))
    chosen.sort(key=lambda f: f.name != CONTROL)

    print(f"config {args.config}; {args.ngpu} ranks; {len(chosen)} flavors; "
          f"{'GPU' if _cuda_count() else 'CPU'}; up to {args.jobs} side by side", flush=True)
    results = {f.name: Result(f) for f in chosen}
    runnable = []
    for f in chosen:
        if f.ranks > args.ngpu:
            results[f.name].status, results[f.name].reason = "SKIPPED", f"needs {f.ranks} ranks, --ngpu {args.ngpu}"
            _print_result(results[f.name])
        else:
            runnable.append(f)
    start = time.monotonic()
    run_matrix(Matrix(args), runnable, results, args.jobs)
    check_parity(Matrix(args), results)
    ordered = list(results.values())
    print_summary(ordered, time.monotonic() - start)
    bad = {"FAIL", "SKIPPED"} if args.require_all else {"FAIL"}
    return 1 if any(r.status in bad for r in ordered) else 0


if __name__ == "__main__":
    sys.exit(main())
