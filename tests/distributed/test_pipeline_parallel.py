"""Pipeline parallelism: stage planning, every schedule, PP composed with FSDP/HSDP/TP/CP, and bad configs.

Training runs use real gloo processes, the debug model (6 layers), float32,
``training.deterministic`` and the same global batch of 8 sequences as a single
non-pipelined process (the control). One process group per world size trains
all of its layouts one after another, so CI pays for spawning each size once.

For every layout the tests check that:
- the stages together hold bitwise the control's initial weights, each weight on
  exactly one stage (the layout-invariant init sees the original FQNs);
- the loss every rank reports (rank 0 holds no output layer) is the control's,
  within the parity tolerance of tests/distributed/test_layout_parity.py;
- so is the global gradient norm (it spans the stages, so ``pp`` must be reduced);
- so is the validation loss on held-out data, evaluated by the forward-only pass
  through the stages after step 2 (training then goes on) and after the last step.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import sys
import time
from collections import Counter

import pytest
import torch
from conftest import DEBUG_CONFIG, debug_config
from dist_harness import run_ranks
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from torchtitan.config import ConfigError, ConfigManager
from torchtitan.distributed.pipeline_parallel import prune_to_stage
from torchtitan.distributed.pipeline_plan import (
    SINGLE_STAGE_SCHEDULES,
    V_SHAPED_SCHEDULES,
    ZERO_BUBBLE_SCHEDULES,
    PipelinePlan,
    schedules,
)

DEBUG = DEBUG_CONFIG
STEPS = 4
RUN = [f"--training.steps={STEPS}", "--training.seq_len=32", "--validation.enable",
       "--validation.held_out_fraction=0.05", "--validation.steps=1"]
VALIDATE_AFTER = (2, STEPS)
STEP1_RTOL, CURVE_RTOL = 1e-6, 1e-4  # as in test_layout_parity.py
# Sharded float32 grad norms differ from one process's by summation order, a few 1e-5 (see
# test_trainer.py); leaving out a stage's share (no reduction over pp) would be off by tens of percent.
NORM_RTOL = 2e-4

MULTI_STAGE = [s for s in schedules() if s not in SINGLE_STAGE_SCHEDULES]
# 4 ranks x 2 stages = 8 stages for 6 layers: the embedding and the output each count as a layer.
WEIGHTS = ["--parallelism.pipeline_parallel_embedding_weight=1", "--parallelism.pipeline_parallel_output_weight=1"]


def _pp(schedule: str, degree: int = 2) -> list[str]:
    return [f"--parallelism.pipeline_parallel_degree={degree}", f"--parallelism.pipeline_parallel_schedule={schedule}"]


# world size -> {layout name: overrides}; the local batch is 8 / dp degree.
LAYOUTS: dict[int, dict[str, list[str]]] = {
    2: {
        **{f"PP 2 {s}": [*_pp(s), "--training.batch_size=8"] for s in schedules() if s not in ("GPipe", "LoopedBFS")},
        # Two local batches per step: gradients accumulate over two schedule steps.
        # The validation batch defaults to the local training batch; the control validates on 8.
        "PP 2 GPipe, 2 accumulation steps": [*_pp("GPipe"), "--training.batch_size=4",
                                             "--training.gradient_accumulation_steps=2", "--validation.batch_size=8"],
        # Explicit, uneven split points: 4 stages of 1, 2, 1 and 2 layers.
        "PP 2 LoopedBFS, split at layers.1,3,4": [
            *_pp("LoopedBFS"), "--training.batch_size=8",
            "--parallelism.pipeline_parallel_split_points=layers.1,layers.3,layers.4"],
    },
    4: {f"PP 4 {s}": [*_pp(s, 4), *WEIGHTS, "--training.batch_size=8"] for s in MULTI_STAGE},
    8: {
        "PP 2 x FSDP 4": [*_pp("1F1B"), "--parallelism.data_parallel_shard_degree=4", "--training.batch_size=2"],
        "PP 2 x HSDP 2x2": [*_pp("Interleaved1F1B"), "--parallelism.data_parallel_replicate_degree=2",
                            "--parallelism.data_parallel_shard_degree=2", "--training.batch_size=2",
                            "--parallelism.pipeline_parallel_microbatches=2"],
        "PP 2 x TP 2 x FSDP 2": [*_pp("1F1B"), "--parallelism.tensor_parallel_degree=2",
                                 "--parallelism.data_parallel_shard_degree=2", "--training.batch_size=4"],
        "PP 2 x TP 2 x CP 2": [*_pp("GPipe"), "--parallelism.tensor_parallel_degree=2",
                               "--parallelism.context_parallel_degree=2", "--training.batch_size=8"],
    },
}


def _cfg(dump: str, *overrides: str):
    return ConfigManager().parse_args(
        ["--job.config_file", DEBUG, f"--job.dump_folder={dump}", "--job.print_args=false",
         "--metrics.enable_tensorboard=false", "--training.deterministic", *RUN, *overrides]
    )


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


class _FsdpCollectives(TorchDispatchMode):
    """Counts the all-gathers and reduce-scatters a rank issues through c10d's base ops (FSDP2's, torch 2.11-2.13;
    TP's go through the functional collectives and are not counted)."""

    OPS = {"_allgather_base_": "all_gather", "_reduce_scatter_base_": "reduce_scatter"}

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's signature
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        if func.namespace == "c10d" and func._opname in self.OPS:
            self.counts[self.OPS[func._opname]] += 1
        return func(*args, **(kwargs or {}))


def _train(dump: str, overrides: list[str]) -> dict:
    """Build a trainer, record its initial full weights, train; the (loss, grad norm) curve is what rank 0 logs."""
    from torchtitan.distributed.layout_init import gather_full_state_dict
    from torchtitan.trainer import Trainer

    trainer = Trainer(_cfg(dump, *overrides))
    full = {}
    for part in trainer.model_parts:
        full.update({fqn: _digest(t) for fqn, t in gather_full_state_dict(part).items()})
    data = iter(trainer.dataloader)
    losses, norms, validation, collectives = [], [], {}, []
    # Counted where FSDP shards (a dispatch mode slows every op a little).
    count = any(o.startswith("--parallelism.data_parallel_shard_degree") for o in overrides)
    for step in range(1, STEPS + 1):
        with _FsdpCollectives() if count else contextlib.nullcontext() as counter:
            out = trainer.train_step([next(data) for _ in range(trainer.grad_accum)])
        collectives.append(dict(counter.counts) if counter is not None else None)
        losses.append(float(out.loss))
        norms.append(float(out.grad_norm))
        if step in VALIDATE_AFTER:
            validation[step] = trainer.validate().loss
    def own_parameters(unit: torch.nn.Module) -> set[int]:  # those no FSDP unit inside ``unit`` holds
        inner = {id(p) for sub in unit.modules() if sub is not unit and isinstance(sub, FSDPModule)
                 for p in sub.parameters()}
        return {id(p) for p in unit.parameters()} - inner

    # The units that hold parameters of their own (a middle stage's root holds none, and gathers nothing).
    fsdp_units = sum(bool(own_parameters(m)) for part in trainer.model_parts for m in part.modules()
                     if isinstance(m, FSDPModule))
    return {"full": full, "losses": losses, "norms": norms, "n_parts": len(trainer.model_parts),
            "validation": validation, "collectives": collectives, "fsdp_units": fsdp_units}


def _train_all(rank: int, world_size: int, dump: str, layouts: dict[str, list[str]]) -> dict:
    out: dict = {"errors": {}}
    if world_size == 2:
        # Bad pipeline configs fail on every rank before any collective; a hang would time the harness out.
        for name, bad in BAD_CONFIGS.items():
            try:
                _train(dump, bad)
                out["errors"][name] = "no error"
            except ConfigError as e:
                out["errors"][name] = str(e)
    for name, overrides in layouts.items():
        start = time.monotonic()
        out[name] = _train(f"{dump}/{len(out)}", overrides)
        if rank == 0:  # shown with the failure if a later layout hangs and the harness times out
            print(f"[{world_size} ranks] {name}: {time.monotonic() - start:.0f}s", file=sys.stderr, flush=True)
    return out


BAD_CONFIGS = {
    "unknown schedule": _pp("OneFOneB"),
    "too few layers": [*_pp("Interleaved1F1B"), "--parallelism.pipeline_parallel_stages_per_rank=4"],
    "batch not divisible": [*_pp("GPipe"), "--training.batch_size=8", "--parallelism.pipeline_parallel_microbatches=3"],
}


@pytest.fixture(scope="module")
def control(tmp_path_factory) -> dict:
    (result,) = run_ranks(_train_control, 1, str(tmp_path_factory.mktemp("control")))
    return result


def _train_control(rank: int, world_size: int, dump: str) -> dict:
    return _train(dump, ["--training.batch_size=8"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    """Layout name -> every rank's result (one process group per world size)."""
    results: dict[str, list[dict]] = {}
    for world_size, layouts in LAYOUTS.items():
        dump = str(tmp_path_factory.mktemp(f"world{world_size}"))
        per_rank = run_ranks(_train_all, world_size, dump, layouts, timeout=1500, collective_timeout=300)
        for name in [*layouts, "errors"]:
            results[name if name != "errors" else f"errors {world_size}"] = [r[name] for r in per_rank]
    return results


ALL_LAYOUTS = [name for layouts in LAYOUTS.values() for name in layouts]


@pytest.mark.slow
@pytest.mark.parametrize("name", ALL_LAYOUTS)
def test_pipeline_layout_matches_control(name, runs, control):
    results = runs[name]
    # Init: the stages together hold exactly the control's weights, bitwise.
    merged: dict[str, str] = {}
    for r in results:
        for fqn, digest in r["full"].items():
            assert merged.setdefault(fqn, digest) == digest, fqn  # replicas and TP/FSDP peers agree
    assert merged == control["full"]

    # Loss and grad norm: every rank reports the global values, equal to the control's.
    losses, reference = results[0]["losses"], control["losses"]
    assert all(r["losses"] == losses and r["norms"] == results[0]["norms"] for r in results)
    rel = [abs(a - b) / abs(b) for a, b in zip(losses, reference)]
    norm_rel = [abs(a - b) / b for a, b in zip(results[0]["norms"], control["norms"])]
    print(f"\n{name}: step-1 rel {rel[0]:.1e}, max rel over {STEPS} steps {max(rel):.1e}, "
          f"grad norm max rel {max(norm_rel):.1e}")
    assert len(losses) == STEPS
    assert rel[0] <= STEP1_RTOL
    assert max(rel) <= CURVE_RTOL
    assert max(norm_rel) <= NORM_RTOL
    # Validation: every rank reports the global value, the control's within the curve tolerance.
    validation = results[0]["validation"]
    assert all(r["validation"] == validation for r in results)
    assert sorted(validation) == list(VALIDATE_AFTER)
    val_rel = max(abs(validation[s] - control["validation"][s]) / control["validation"][s] for s in VALIDATE_AFTER)
    print(f"{name}: validation loss max rel {val_rel:.1e}")
    assert val_rel <= CURVE_RTOL


@pytest.mark.slow
def test_pipeline_ranks_hold_disjoint_stages(runs):
    # PP 2: ranks 0 and 1 split the model between them; PP 4 with two stages per rank likewise.
    for name, stages_per_rank in {"PP 2 1F1B": 1, "PP 4 Interleaved1F1B": 2}.items():
        results = runs[name]
        owned = [set(r["full"]) for r in results]
        for i in range(len(owned)):
            for j in range(i + 1, len(owned)):
                assert not owned[i] & owned[j], (name, i, j)
        assert all(r["n_parts"] == stages_per_rank for r in results)
    pp2 = runs["PP 2 1F1B"]
    assert "tok_embeddings.weight" in pp2[0]["full"] and "output.weight" in pp2[1]["full"]
    assert "layers.2.attention.wq.weight" in pp2[0]["full"] and "layers.3.attention.wq.weight" in pp2[1]["full"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["PP 2 x FSDP 4", "PP 2 x HSDP 2x2", "PP 2 x TP 2 x FSDP 2"])
def test_pipeline_stages_gather_once_and_reduce_scatter_once_per_step(name, runs):
    """Optimizer-only sharding of the stages: the parameters stay gathered across the micro-batches (one all-gather
    per FSDP unit per step) and each unit's gradients are reduce-scattered once per step, not per micro-batch."""
    for r in runs[name]:
        units = r["fsdp_units"]
        first, *rest = r["collectives"]
        assert rest == [{"all_gather": units, "reduce_scatter": units}] * (STEPS - 1), (name, units)
        # The schedule's first step also runs the forward that learns the stages' shapes; whether the real forward
        # gathers again after it is torch's choice (see _gathers_of_a_units_first_step).
        assert first == {"all_gather": _gathers_of_a_units_first_step() * units, "reduce_scatter": units}, (name, units)


@functools.cache
def _gathers_of_a_units_first_step() -> int:
    """How many of a schedule's first-step forwards find an FSDP unit (kept gathered after its forward) sharded,
    each an all-gather; tried on one unit as rank 0 of a fake 2-rank world (no process starts).

    Both releases run the stage's forward once to learn its shapes, which gathers the unit. torch 2.13 then
    reshards every FSDP module of the stage (``_post_metadata_inference_cleanup``), so the first real forward
    gathers again: 2. torch 2.11's shape inference (``_shape_inference``, a no-grad forward) leaves it gathered: 1.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    from torchtitan import compat

    dist.init_process_group("fake", store=compat.fake_process_group_store(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "dp"))
        unit = torch.nn.Linear(4, 4)
        fully_shard(unit, mesh=mesh["dp"], reshard_after_forward=False)
        found_sharded: list[bool] = []  # a sharded unit holds its weight as a DTensor, a gathered one as a tensor
        unit.register_forward_pre_hook(lambda m, _: found_sharded.append(isinstance(m.weight, DTensor)), prepend=True)
        stage = PipelineStage(unit, 0, 1, torch.device("cpu"), group=mesh.get_group("pp"))
        ScheduleGPipe(stage, 1, loss_fn=lambda out, target: out.sum()).step(torch.ones(1, 4), target=torch.zeros(1, 4))
    finally:
        dist.destroy_process_group()
    assert len(found_sharded) == 2, f"expected a shape-learning forward and one micro-batch's: {found_sharded}"
    return sum(found_sharded)


@pytest.mark.slow
def test_control_learns(control):
    assert control["losses"][-1] < control["losses"][0] - 0.1


@pytest.mark.slow
def test_bad_configs_fail_on_every_rank_without_a_collective(runs):
    errors = runs["errors 2"]
    assert errors[0] == errors[1]
    assert "OneFOneB: unknown; choose one of" in errors[0]["unknown schedule"]
    assert all(s in errors[0]["unknown schedule"] for s in schedules())
    assert "8 stages (2 ranks x 4 per rank) but the model has only 6 layers" in errors[0]["too few layers"]
    assert "batch_size=8 is not divisible by 3 microbatches" in errors[0]["batch not divisible"]


# ---- planning (no processes) ---------------------------------------------------------------


def _plan(*overrides: str, n_layers: int = 6) -> PipelinePlan:
    cfg = ConfigManager().parse_args(list(overrides))
    return PipelinePlan.from_config(cfg.parallelism, cfg.training, cfg.activation_checkpoint, n_layers)


def _plan_error(*overrides: str, n_layers: int = 6) -> str:
    with pytest.raises(ConfigError) as info:
        _plan(*overrides, n_layers=n_layers)
    return str(info.value)


def test_even_split_and_looped_placement():
    plan = _plan(*_pp("1F1B"))
    assert plan.layer_starts == (0, 3, 6) and plan.microbatches == 2
    assert [plan.stage_ids(r) for r in range(2)] == [[0], [1]]
    plan = _plan(*_pp("interleaved1f1b", 4), n_layers=32)  # names are case-insensitive
    assert plan.schedule == "Interleaved1F1B" and plan.num_stages == 8 and plan.microbatches == 8
    assert plan.layer_starts == tuple(range(0, 33, 4))
    assert [plan.stage_ids(r) for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_embedding_and_output_weights_shift_layers_off_the_end_stages():
    # 32 layers + 1 + 1 over 3 stages: 11, 12 and 11 units.
    plan = _plan(*_pp("1F1B", 3), *WEIGHTS, "--training.batch_size=3", n_layers=32)
    assert plan.layer_starts == (0, 10, 22, 32)
    # A heavy output: 6 layers + 1 + 3 over 2 stages: the last stage keeps 2 layers.
    plan = _plan(*_pp("GPipe"), "--parallelism.pipeline_parallel_embedding_weight=1",
                 "--parallelism.pipeline_parallel_output_weight=3")
    assert plan.layer_starts == (0, 4, 6)
    plan = _plan(*_pp("LoopedBFS", 4), *WEIGHTS)
    assert plan.layer_starts == (0, 0, 1, 2, 3, 4, 5, 6, 6)
    assert "stage 0: embedding; stage 1: layer 0;" in plan.describe()
    assert plan.describe().endswith("stage 7: norm+output")


@pytest.mark.skipif(V_SHAPED_SCHEDULES[0] not in schedules(), reason="this torch has no ZBVZeroBubble")
def test_v_schedule_places_stages_in_a_v():
    plan = _plan(*_pp("ZBVZeroBubble", 4), *WEIGHTS)
    assert [plan.stage_ids(r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]


def test_split_points():
    plan = _plan(*_pp("LoopedBFS"), "--parallelism.pipeline_parallel_split_points=layers.1,layers.3,layers.4")
    assert plan.layer_starts == (0, 1, 3, 4, 6) and plan.stages_per_rank == 2
    assert "not a layer FQN" in _plan_error(*_pp("1F1B"), "--parallelism.pipeline_parallel_split_points=norm")
    assert "not a layer FQN" in _plan_error(*_pp("1F1B"), "--parallelism.pipeline_parallel_split_points=layers.6")
    assert "increasing order" in _plan_error(*_pp("LoopedBFS"),
                                             "--parallelism.pipeline_parallel_split_points=layers.3,layers.3,layers.4")
    assert "do not divide evenly" in _plan_error(*_pp("1F1B"),
                                                 "--parallelism.pipeline_parallel_split_points=layers.2,layers.4")
    assert "contradicts the split points" in _plan_error(
        *_pp("LoopedBFS"), "--parallelism.pipeline_parallel_split_points=layers.3",
        "--parallelism.pipeline_parallel_stages_per_rank=2")


def test_schedule_constraints_are_config_errors():
    assert "runs one stage per rank" in _plan_error(*_pp("GPipe"), "--parallelism.pipeline_parallel_stages_per_rank=2")
    assert "needs >= 2 stages per rank" in _plan_error(*_pp("LoopedBFS"),
                                                       "--parallelism.pipeline_parallel_stages_per_rank=1")
    assert "at least as many microbatches as stages" in _plan_error(
        *_pp("1F1B", 4), "--parallelism.pipeline_parallel_microbatches=2")
    assert "at least pipeline_parallel_degree=4 microbatches" in _plan_error(
        *_pp("Interleaved1F1B", 4), *WEIGHTS, "--parallelism.pipeline_parallel_microbatches=2")
    assert "not a multiple of the number of rounds" in _plan_error(
        *_pp("Interleaved1F1B", 2), "--training.batch_size=10", "--parallelism.pipeline_parallel_microbatches=5")
    assert "without layers" in _plan_error(*_pp("Interleaved1F1B", 2),
                                           "--parallelism.pipeline_parallel_output_weight=8")
    if "ZBVZeroBubble" in schedules():
        assert "exactly 2 stages per rank" in _plan_error(*_pp("ZBVZeroBubble"), "--training.batch_size=6",
                                                          "--parallelism.pipeline_parallel_stages_per_rank=3")
        assert "--training.compile" in _plan_error(*_pp("ZBVZeroBubble"), "--training.compile")
        for per_op in ("op", "moe"):
            assert "op-level selective activation checkpointing" in _plan_error(
                *_pp("ZBVZeroBubble"), "--activation_checkpoint.mode=selective",
                f"--activation_checkpoint.selective_ac_option={per_op}")
        _plan(*_pp("ZBVZeroBubble"), "--activation_checkpoint.mode=full")  # recomputing whole blocks is fine


@pytest.mark.skipif("DualPipeV" not in schedules(), reason="this torch has no ScheduleDualPipeV")
def test_dualpipev_constraints_are_config_errors_naming_the_fix():
    """torch's own requirements (2 stages a rank, V-shaped; microbatches >= stages), refused by the plan in one line
    that names the option and the fix, before torch's constructor would raise on every rank."""
    assert _plan_error(*_pp("DualPipeV"), "--parallelism.pipeline_parallel_microbatches=2") == (
        "--parallelism.pipeline_parallel_schedule=DualPipeV needs at least as many microbatches as stages (4); got 2: "
        "set --parallelism.pipeline_parallel_microbatches to a divisor of --training.batch_size that is >= 4")
    plan = _plan(*_pp("DualPipeV", 4), *WEIGHTS, "--training.batch_size=8")  # the default: one microbatch a stage
    assert plan.microbatches == 8 and [plan.stage_ids(r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert _plan_error(*_pp("DualPipeV"), "--training.batch_size=6",
                       "--parallelism.pipeline_parallel_stages_per_rank=3") == (
        "--parallelism.pipeline_parallel_schedule=DualPipeV needs exactly 2 stages per rank (got 3); set "
        "--parallelism.pipeline_parallel_stages_per_rank=2 or give pipeline_parallel_degree * 2 - 1 split points")
    assert "--training.compile" in _plan_error(*_pp("DualPipeV"), "--training.compile")
    assert "op-level selective activation checkpointing" in _plan_error(
        *_pp("DualPipeV"), "--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_ac_option=moe")


@pytest.mark.skipif("DualPipeV" not in schedules(), reason="this torch has no ScheduleDualPipeV")
def test_dualpipev_with_mtp_is_refused_before_any_process_group():
    """The V shape puts the first and the last stage on one rank, both holding the embedding the MTP modules share."""
    from conftest import REPO

    from torchtitan.preflight import preflight

    cfg = ConfigManager().parse_args(["--job.config_file", str(REPO / "train_configs" / "deepseek_v3_debug.toml"),
                                      "--model.mtp_layers=1", *_pp("DualPipeV"), "--training.batch_size=4",
                                      "--parallelism.data_parallel_shard_degree=1"])
    with pytest.raises(ConfigError) as info:
        preflight(cfg, 2)
    assert info.value.problems == [
        "--model.mtp_layers=1 with --parallelism.pipeline_parallel_schedule=DualPipeV: the V-shaped schedule puts the "
        "first and the last stage, which both hold the embedding the MTP modules share, on one rank; use a looped "
        "schedule (1F1B, Interleaved1F1B, ...) or --model.mtp_layers=0"]


def test_preflight_reports_pipeline_errors_before_any_process_group():
    from torchtitan.preflight import preflight

    with pytest.raises(ConfigError, match="choose one of"):
        preflight(debug_config(*_pp("OneFOneB")), 2)
    cfg = debug_config(*_pp("1F1B"), "--training.batch_size=2")
    plan = preflight(cfg, 2)
    assert plan.pipeline is not None and plan.pipeline.layer_starts == (0, 3, 6)
    assert preflight(debug_config(), 2).pipeline is None


def test_pruned_stage_keeps_fqns_and_the_unsplit_init():
    from torchtitan.distributed.layout_init import init_params_layout_invariant
    from torchtitan.models.common.decoder import Decoder
    from torchtitan.models.common.parallel import prune_stage
    from torchtitan.models.llama3 import ModelArgs

    args = ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32, max_seq_len=16)
    with torch.device("meta"):
        meta = Decoder(args)
    whole = Decoder(args)
    whole.init_buffers()
    init_params_layout_invariant(whole, seed=5)
    expected = dict(whole.named_parameters())
    plan = _plan(*_pp("1F1B"), n_layers=4)
    tokens = torch.randint(0, 128, (2, 16))
    hidden = tokens
    for stage_id in range(plan.num_stages):
        stage = prune_to_stage(meta, plan, stage_id, prune_stage).to_empty(device="cpu")
        stage.init_buffers()
        init_params_layout_invariant(stage, seed=5)
        names = dict(stage.named_parameters())
        assert (stage.tok_embeddings is None) == (stage_id != 0) and (stage.output is None) == (stage_id == 0)
        for fqn, param in names.items():
            assert torch.equal(param, expected[fqn]), fqn  # same FQN, same full value, same depth-scaled std
        with torch.no_grad():
            hidden = stage(hidden)
        assert torch.equal(stage.rope_cache, whole.rope_cache)
    with torch.no_grad():
        torch.testing.assert_close(hidden, whole(tokens), rtol=0, atol=0)  # the stages compose to the model
    assert isinstance(hidden, torch.Tensor) and not isinstance(hidden, DTensor)


def test_zero_bubble_with_checkpointing_says_what_it_recomputes(caplog):
    zero_bubble = [n for n in ZERO_BUBBLE_SCHEDULES if n in schedules()]
    assert zero_bubble
    for name in zero_bubble:
        stages = 4 if name in V_SHAPED_SCHEDULES else 2
        extra = ["--training.batch_size=4", "--parallelism.pipeline_parallel_microbatches=4"] if stages == 4 else []
        for mode, warns in (("full", True), ("none", False)):
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="torchtitan.distributed.pipeline_plan"):
                _plan(*_pp(name), *extra, f"--activation_checkpoint.mode={mode}")
            lines = [r.getMessage() for r in caplog.records]
            assert bool(lines) == warns, (name, mode, lines)
            assert all("--activation_checkpoint.mode=none" in line and name in line for line in lines)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="torchtitan.distributed.pipeline_plan"):
        _plan(*_pp("1F1B"), "--activation_checkpoint.mode=full")
    assert not caplog.records
