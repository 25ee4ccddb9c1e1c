"""The training loop: build mesh -> seed -> data -> model runner (model on meta -> parallelize -> init ->
optimizer, ``train_step/build.py``) -> step strategy -> checkpointer -> train.

Everything that can be checked without communication (degrees, flavor, tokenizer,
dataset, batch arithmetic, checkpoints) is checked in ``torchtitan/preflight.py``
*before* the process group exists, so a bad config fails identically on every rank
instead of hanging.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from torchtitan.batch import Batch
from torchtitan.checkpoint import CheckpointManager
from torchtitan.checkpoint.manager import CheckpointOptions
from torchtitan.config import JobConfig, to_toml
from torchtitan.datasets import HeldOutSplit, build_dataloader
from torchtitan.datasets.mixture import mixture_metrics, start_data_at
from torchtitan.datasets.partition import job_data_layout
from torchtitan.datasets.token_bytes import token_byte_lengths
from torchtitan.distributed import init_distributed, manual_seed, set_determinism
from torchtitan.distributed.lifecycle import set_collective_timeout
from torchtitan.downstream.build import EvalOptions, build_downstream_evaluator
from torchtitan.evaluate import ValidationOptions, ValidationResult, Validator, build_validation_data
from torchtitan.launch_plan import LaunchPlan
from torchtitan.metrics import MetricsLogger, Throughput, device_memory, format_step_line, peak_flops
from torchtitan.metrics.logger import format_batch_line, format_mesh_line, format_validation_line
from torchtitan.metrics.profiling import maybe_profile
from torchtitan.metrics.wandb_run import wandb_run_from_config
from torchtitan.preflight import preflight
from torchtitan.stability import BadStepGuard
from torchtitan.stability.rollback import Rollback
from torchtitan.train_step.base import StepOutput, StepParts
from torchtitan.train_step.build import build_runner
from torchtitan.train_step.callbacks import StepCallback, StepCallbacks
from torchtitan.train_step.inject import NonFiniteGradInjector
from torchtitan.train_step.readout import StepReadout
from torchtitan.train_step.select import build_step_strategy

logger = logging.getLogger(__name__)


class Trainer:
    """Builds a job (mesh, data, the model runner, the step strategy, the checkpointer) and trains it.

    ``callbacks`` are called at the named points of every step (``train_step/callbacks.py``).
    """

    def __init__(self, cfg: JobConfig, callbacks: Iterable[StepCallback] = ()):
        self.cfg = cfg
        self.callbacks = StepCallbacks(callbacks)
        plan = preflight(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        self.dims, self.grad_accum, self.model_args = plan.dims, plan.grad_accum, plan.model_args
        self.model_spec = plan.model_spec  # the model family (models/registry.py)
        self.pipeline = plan.pipeline

        self.rank, _, self.device = init_distributed(cfg.comm.init_timeout_seconds)
        try:
            self._build(plan)
        except BaseException:
            # Half built: close what exists (a metrics writer, a pending save) before the error leaves.
            self.close(wait_for_peers=False)
            raise

    def _build(self, plan: LaunchPlan) -> None:
        cfg = self.cfg
        self.mesh = self.dims.build_mesh(self.device.type)
        self.loss_mesh = self.dims.get_mesh("dp_cp")  # the ranks that see different tokens
        enabled = self.dims.enabled_dims  # the mesh keeps degree-1 axes too; the line names the parallel ones
        logger.info(format_mesh_line(tuple(enabled), tuple(self.dims.degree(d) for d in enabled)))
        self._write_config()
        self._seed()
        set_determinism(cfg.training.deterministic)

        dp_rank, dp_degree = self.dims.rank_and_size("dp")
        # Under fault tolerance each group reads its own slots of the job's global batch.
        # The rank's global batch: one micro-step of the job.
        self.data_layout = job_data_layout(cfg.training, cfg.fault_tolerance, dp_rank, dp_degree)
        self.dataloader = build_dataloader(
            dataset_name=cfg.training.dataset, dataset_path=cfg.training.dataset_path, tokenizer=plan.tokenizer,
            layout=self.data_layout, split=HeldOutSplit.from_config(cfg.validation),
            shuffle=cfg.training.shuffle, seed=cfg.training.shuffle_seed,
            positions=self.model_args.attn_mask_type == "block_causal",  # batches then carry them third
            mix=cfg.training.dataset_mix, new_phase=cfg.training.dataset_mix_new_phase,
        )
        if cfg.validation.held_out_fraction is not None and self.rank == 0:
            logger.info("Training data: %g of the documents held out for validation (split_seed %d)",
                        cfg.validation.held_out_fraction, cfg.validation.split_seed)
        # The model parts (one per pipeline stage held by this rank; a single part without PP), the
        # pipeline schedule, the optimizer and the LR schedule: built as the planner's dry run builds them.
        self.runner = build_runner(cfg, self.dims, plan, self.device, self.callbacks)
        self.model_parts: list[torch.nn.Module] = self.runner.model_parts
        self.optimizer, self.lr_scheduler = self.runner.optimizer, self.runner.lr_scheduler
        self._setup_stability()
        self.step = 0
        self.readout = StepReadout()  # the steps' losses, read on the host only on the steps that need them
        self._setup_metrics()
        self.validator: Validator | None = None
        self.validation_losses: dict[int, float] = {}  # step -> validation loss, for tests and scripts
        self.validation_results: dict[int, ValidationResult] = {}  # step -> the whole result (bytes, sources)
        if cfg.validation.enable:
            validation = ValidationOptions.of(cfg.validation, cfg.training, cfg.model)
            self.validator = Validator(
                validation, build_validation_data(validation, plan.tokenizer, dp_rank, dp_degree), self.model_parts,
                self.runner.validation_forward, self.loss_mesh, self.dims.get_mesh("pp"), self.device,
                token_byte_lengths(plan.tokenizer), self.dims.degree("cp"),
            )
        # Downstream tasks ([eval]), scored through the same forward as validation.
        self.evaluator = build_downstream_evaluator(EvalOptions.of(cfg.eval, cfg.validation, cfg.training, cfg.model),
                                                    plan.tokenizer, self.runner, self.dims, self.device)
        self.eval_scores: dict[int, dict[str, float]] = {}  # step -> eval/<task>/<score>, for tests and scripts
        # The plain step, or this replica group's step under fault tolerance; built before the
        # checkpointer, which it tells who writes the job's checkpoints and what else they hold.
        self.step_strategy = build_step_strategy(cfg.fault_tolerance, StepParts(
            runner=self.runner, loss_mesh=self.loss_mesh, pp_mesh=self.dims.get_mesh("pp"),
            max_norm=cfg.training.max_norm, dataloader=self.dataloader, guard=self.guard), self.device)
        extra_states = self.step_strategy.checkpoint_states()
        if self.guard is not None:
            extra_states["stability"] = self.guard
        self.checkpointer = CheckpointManager(
            CheckpointOptions.of(cfg.checkpoint, cfg.job, cfg.training, cfg.comm, cfg.fault_tolerance),
            model_parts=self.model_parts, optimizer=self.optimizer, lr_scheduler=self.lr_scheduler,
            dataloader=self.dataloader, dims=self.dims, rank=self.rank, model_args=self.model_args,
            writes=self.step_strategy.writes_checkpoint, extra_states=extra_states,
        )

    # ---- set-up -------------------------------------------------------------
    def _write_config(self) -> None:
        if self.rank != 0:
            return
        text = to_toml(self.cfg)
        folder = Path(self.cfg.job.dump_folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.toml").write_text(text)
        if self.cfg.job.print_args:
            logger.info("Effective config (%s):\n%s", self.cfg.job.description, text)

    def _seed(self) -> None:
        t = self.cfg.training
        if t.seed is None:
            logger.info("training.seed is unset: no seeding, so runs are not reproducible")
            return
        rank_seed = manual_seed(t.seed, dims=self.dims, sharded_dims=t.seed_sharded_dims)
        logger.debug("Rank %d seed %d (sharded dims %s)", self.rank, rank_seed, t.seed_sharded_dims)
        if self.rank == 0:
            logger.info("Seeded: rank 0 seed %d, sharded dims %s", rank_seed, t.seed_sharded_dims)

    def _setup_stability(self) -> None:
        """[stability]'s guard and rollback, and --debug.inject_nonfinite_grad's callback (docs/stability.md)."""
        cfg = self.cfg
        self.guard: BadStepGuard | None = None
        self.rollback: Rollback | None = None
        if cfg.stability.guards_steps:
            BadStepGuard.check_optimizer(self.optimizer)
            self.guard = BadStepGuard(cfg.stability, self.device)
            if cfg.stability.max_consecutive_skips:
                per_step = self.grad_accum * self.data_layout.global_batch_size
                self.rollback = Rollback(self.guard, per_step, self.rank)
        if cfg.debug.inject_nonfinite_grad:
            self.callbacks.add(NonFiniteGradInjector(cfg.debug.inject_nonfinite_grad))

    def _setup_metrics(self) -> None:
        cfg = self.cfg
        peak = peak_flops(torch.cuda.get_device_name(self.device)) if self.device.type == "cuda" else None
        if peak is None and self.rank == 0:
            logger.info("MFU not reported: no peak FLOP/s known for device %s", self.device)
        self.throughput = Throughput(total_steps=cfg.training.steps, flops_per_token=self.runner.flops_per_token,
                                     peak_flops=peak)
        tb_dir = os.path.join(cfg.job.dump_folder, cfg.metrics.save_tb_folder)
        self.metrics_logger = MetricsLogger(tb_dir, cfg.metrics.enable_tensorboard, rank=self.rank,
                                            wandb_run=wandb_run_from_config(cfg.metrics, cfg.job.dump_folder,
                                                                            cfg.to_dict()) if self.rank == 0 else None)

    # ---- training -------------------------------------------------------------
    def train_step(self, batches: Sequence[Batch | Sequence[torch.Tensor]]) -> StepOutput:
        """One optimizer step over ``batches`` (the micro-batches), by the job's step strategy."""
        return self.step_strategy.run(batches, self.step)

    def train(self) -> list[float]:
        """Train to ``training.steps`` (or until preempted); then close the checkpointer and the metrics.

        Returns the loss of every step this run took (read on the host in batches, see ``StepReadout``).
        """
        try:
            self._train()
            self.readout.read()  # losses not read yet (none when the last step logged)
        except BaseException:
            self.close(wait_for_peers=False)
            raise
        self.close()
        losses = self.readout.losses
        if not self.cfg.checkpoint.create_seed_checkpoint:
            logger.info("Training done: %d steps, final loss %s", self.step,
                        f"{losses[-1]:.5f}" if losses else "n/a")
        return losses

    def _train(self) -> None:
        cfg = self.cfg
        if cfg.checkpoint.create_seed_checkpoint:
            self.checkpointer.save_seed()
            return
        self.step = self.checkpointer.load()  # before iter(): the loader resumes from the loaded position
        start_data_at(self.dataloader, self.step * self.grad_accum * self.data_layout.global_batch_size)
        self.metrics_logger.start(self.step)  # a resumed job continues its W&B run
        self.step_strategy.begin(self.step, self.grad_accum)
        logger.info(format_batch_line(cfg.training.steps, cfg.training.batch_size, cfg.training.seq_len,
                                      self.grad_accum, self.dims.degree("dp")))
        trace_dir = os.path.join(cfg.job.dump_folder, cfg.profiling.save_traces_folder)
        with maybe_profile(cfg.profiling.enable_profiling, trace_dir, cfg.profiling.profile_freq, self.rank) as prof:
            while self.step < cfg.training.steps:
                if not self._run_step():
                    continue  # rolled back to a checkpoint: nothing of this step to save
                if prof is not None:
                    prof.step()
                if self.checkpointer.maybe_save(self.step):
                    break  # preempted: the checkpoint of this step is saved

    def close(self, wait_for_peers: bool = True) -> None:
        """Wait for an async save and commit it, then close the metrics; safe to call twice.

        Also works on a trainer whose construction failed half-way. ``wait_for_peers=False``
        (a failure) skips the checkpoint group's barrier: the other ranks may never get there.
        """
        checkpointer = getattr(self, "checkpointer", None)
        step_strategy = getattr(self, "step_strategy", None)
        try:
            if step_strategy is not None:
                step_strategy.close(wait=wait_for_peers)
            if checkpointer is not None:
                checkpointer.close(wait_for_peers=wait_for_peers)
        finally:
            metrics_logger = getattr(self, "metrics_logger", None)
            if metrics_logger is not None:
                metrics_logger.close()

    def _run_step(self) -> bool:
        """Load the micro-batches, take one optimizer step, log every ``metrics.log_freq`` steps; False when
        the step's read found a rollback due ([stability]) and the run went back to its last checkpoint.

        The step's loss and grad norm stay on the device; they are read on the host (and the
        losses checked for finiteness) only on a step that logs, validates or may checkpoint.
        """
        cfg = self.cfg
        self.step += 1
        self.throughput.step_begin()
        out = self.step_strategy.next_step(self.step, loaded=self.throughput.data_loaded)
        self.step = out.step  # a fault-tolerant step that healed took a live peer's step
        self.readout.add(out)
        if self.readout.steps_taken == 1:
            # The first step of this run (also after a resume) pays for compilation and lazy set-up;
            # later ones should be quick.
            set_collective_timeout(cfg.comm.train_timeout_seconds)
        log = self.step % cfg.metrics.log_freq == 0 or self.step == cfg.training.steps
        validate = self.validator is not None and self.validator.due(self.step)
        evaluate = self.evaluator is not None and self.evaluator.due(self.step)
        log = log or evaluate  # the scores go on the step's line
        loss, now = math.nan, {}
        if log or validate or self.checkpointer.may_save(self.step):
            # One host read; raises at a non-finite loss (of a step not skipped).
            loss, now = self.readout.read(self._read_now(out))
            if now.get("rollback_due"):
                self._roll_back()
                return False
        # The step ends after the read: on a GPU the host runs ahead of the device until something waits for
        # it, and the read is that wait. So a log window's time is the device's time for its steps; ended
        # before the read, it counted only the host's (benchmarks/README.md section 21).
        # The tp x cp x pp ranks of one data-parallel rank share its tokens: count each device's share,
        # so tokens/s and MFU are per device (flops_per_token is for the whole model).
        self.throughput.step_end(tokens=out.tokens / self.dims.non_data_parallel_size)
        scores = self._evaluate() if evaluate else {}
        if log:
            self._log(loss, now, out.lr, scores)
        if validate:
            self.validate()
        return True

    def validate(self) -> ValidationResult:
        """Evaluate on the validation data now; log and record the result at the current step."""
        assert self.validator is not None, "validate() runs only where validation is configured"
        result = self.validator.run()
        t = self.cfg.training
        trained = self.step * self.grad_accum * self.data_layout.global_batch_size * t.seq_len
        metrics = {"validation/loss": result.loss, "validation/perplexity": result.perplexity,
                   "validation/bpb": result.bpb, "validation/tokens": result.tokens,
                   "validation/train_tokens_seen": trained,
                   **result.source_metrics()}
        if self.rank == 0:
            logger.info(format_validation_line(self.step, result.loss, result.perplexity, result.tokens,
                                               result.batches, trained, result.bpb) + result.sources_line())
        self.metrics_logger.log(self.step, metrics)
        self.validation_losses[self.step] = result.loss
        self.validation_results[self.step] = result
        return result

    def _evaluate(self) -> dict[str, float]:
        """Score the downstream tasks now (every rank); record them at the current step."""
        assert self.evaluator is not None, "_evaluate() runs only where [eval] has tasks"
        scores = self.evaluator.run()
        self.eval_scores[self.step] = scores
        return scores

    def _read_now(self, out: StepOutput) -> dict[str, torch.Tensor | None]:
        """The step's values read with its loss: the grad norm, the loss terms' (z-loss), and [stability]'s
        counters."""
        guard = self.guard
        return {"grad_norm": out.grad_norm, **out.terms,
                "skipped_steps": None if guard is None else guard.skipped,
                "rollback_due": None if guard is None else guard.rollback_due}

    def _roll_back(self) -> None:
        """Too many bad steps in a row: back to the last checkpoint, past the data after it (stability/rollback.py)."""
        assert self.rollback is not None, "only a guard with max_consecutive_skips flags a rollback"
        self.step, data = self.rollback(self.checkpointer, self.step, self.step_strategy.start, self.grad_accum)
        self.step_strategy.begin(self.step, self.grad_accum, data)
        self.throughput.reset_window()

    def _log(self, loss: float, now: dict[str, float], lr: float, scores: dict[str, float]) -> None:
        experts = self.runner.experts  # a collective over the world: every rank logs on the same steps
        now = {name: value for name, value in now.items() if name != "rollback_due"}
        metrics = {"loss": loss, "grad_norm": math.nan, **now, "lr": lr, **scores, **self.throughput.metrics(),
                   **device_memory(self.device), **mixture_metrics(self.dataloader),
                   **(experts.metrics() if experts is not None else {})}
        # the loss terms' own values (collectives, on logging steps) over the data ranks and the stages (the last
        # holds them)
        meshes = (self.loss_mesh, self.dims.get_mesh("pp"))
        metrics.update(self.runner.objective.metrics([m.get_group() for m in meshes if m is not None]))
        self.throughput.reset_window()
        if self.rank == 0:
            logger.info(format_step_line(self.step, metrics))
        self.metrics_logger.log(self.step, metrics)
