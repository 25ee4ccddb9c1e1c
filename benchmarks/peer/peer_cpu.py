"""The peer's side of the CPU comparison: its own Trainer on the project's debug shape, timed per step.

Runs inside the peer's process (one per rank, under ``torchrun``), started by
``peer_torchtitan.py --device cpu``; it never imports the project. The driver
(``peer_cpu_compare.py``) hands it three things the project also uses:

* ``--windows``: the token windows each rank reads at each step, dumped from the project's
  own loader (``[steps, ranks, batch, seq + 1]`` int64), replayed here in the same order;
* ``--init-hf``: the project's initial weights exported in Hugging Face format, loaded by the
  peer's own checkpoint code (``initial_load_in_hf``);
* the learning-rate schedule, written in the peer's terms so that every step's rate equals the
  project's (``peer_lr_schedule``; the driver checks it step by step).

Each rank writes ``<out>/peer_rank<r>.json``: per-step wall and CPU time stamps, loss,
grad norm and learning rate (the project worker of ``peer_cpu_compare.py`` writes the same).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path
from typing import Any

import torch

# The project's debug shape (torchtitan/models/llama3/args.py, "debugmodel"): the peer's
# debug flavor differs in K/V heads (16) and RoPE scaling ("llama"), so both are set here.
DEBUG_SHAPE = {"dim": 256, "n_layers": 6, "n_heads": 16, "n_kv_heads": 8, "vocab_size": 2048,
               "rope_theta": 500000.0, "max_seq_len": 2048}


def stamp() -> dict[str, float]:
    """Now, for one step's record: wall and CPU seconds, the kernel's share of the CPU
    seconds, and the minor page faults so far (fresh pages the kernel zeroed and mapped)."""
    return {"wall": time.perf_counter(), "cpu": time.process_time(), "sys": os.times().system,
            "minflt": resource.getrusage(resource.RUSAGE_SELF).ru_minflt}


def add_cpu_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--windows", help="token windows [steps, ranks, batch, seq+1] (torch.save)")
    p.add_argument("--assets", help="folder with tokenizer/ (tokenizer.json) and corpus/ (jsonl) the peer "
                   "builds its tokenizer and loader from before the windows replace the loader")
    p.add_argument("--init-hf", help="initial weights, a Hugging Face folder (absolute)")
    p.add_argument("--out", help="folder for peer_rank<r>.json")
    p.add_argument("--warmup-steps", type=int, default=2, help="the project's lr_scheduler.warmup_steps")
    p.add_argument("--lr-min", type=float, default=0.1, help="the project's lr_scheduler.lr_min")
    p.add_argument("--profile-dir", help="folder: torch.profiler table of the whole run, rank 0")


def peer_lr_schedule(warmup_steps: int, total_steps: int, lr_min: float) -> dict[str, Any]:
    """The peer's LR config whose rate at every step equals the project's (warmup W, linear decay
    to lr_min right after it, reached at step T).

    The project's factor at step s is s/(W+1) for s <= W, then 1 - (1 - lr_min)(s - W)/(T - W),
    except that the decay starts only after a full-rate step when, as here, a stable step is
    asked for. The peer's LambdaLR factor is (k+1)/W' during warmup (k = s - 1), 1.0 for one
    stable step after it, then a linear decay over ``total_steps - W'`` steps. With W' = W + 1 and
    total_steps = T - 1 the peer gives s/(W+1), 1.0 at s = W+1 and s = W+2, then
    1 - (1 - lr_min)(s - W - 2)/(T - W - 2): the project matches it with a decay of
    T - W - 2 steps (``project_decay_ratio``).
    """
    return {"warmup_steps": warmup_steps + 1, "decay_ratio": None, "decay_type": "linear",
            "min_lr_factor": lr_min, "total_steps": total_steps - 1}


def project_decay_ratio(warmup_steps: int, total_steps: int) -> float:
    """The project's ``lr_scheduler.decay_ratio`` that ``peer_lr_schedule`` matches."""
    return (total_steps - warmup_steps - 2) / total_steps


def build_model_spec() -> Any:
    """The peer's Llama 3 model spec in the project's debug shape, causal SDPA attention.

    The peer builds language models with Flex attention only, which needs a GPU; its SDPA module
    (causal, no document masks) computes what the project's attention computes on these windows.
    """
    from torchtitan.models.common import ComplexRoPE, compute_ffn_hidden_dim
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import _build_llama3_layers, model_registry

    s = DEBUG_SHAPE
    spec = model_registry("debugmodel")
    assert spec.model.dim == s["dim"] and spec.model.vocab_size == s["vocab_size"]
    rope = ComplexRoPE.Config(dim=s["dim"] // s["n_heads"], max_seq_len=s["max_seq_len"],
                              theta=s["rope_theta"], scaling="none")
    spec.model.layers = _build_llama3_layers(
        n_layers=s["n_layers"], dim=s["dim"], n_heads=s["n_heads"], n_kv_heads=s["n_kv_heads"],
        hidden_dim=compute_ffn_hidden_dim(s["dim"], multiple_of=256), rope=rope, attn_backend="flex")
    for layer in spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return spec


def build_config(args: argparse.Namespace, batch: int, seq: int, steps: int, work: Path) -> Any:
    from torchtitan.components.optimizer import LRSchedulersContainer
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    config.model_spec = build_model_spec()
    assets = Path(args.assets)
    config.hf_assets_path = str(assets / "tokenizer")  # the project's tokenizer.json
    config.dataloader = HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=str(assets / "corpus"))
    config.dump_folder = str(work / "peer_out")
    config.training.local_batch_size, config.training.seq_len, config.training.steps = batch, seq, steps
    config.training.max_norm = 1.0
    config.training.mixed_precision_param = "float32"  # the project on CPU ("auto"); the peer: bfloat16
    config.debug.seed = 42  # unused when --init-hf gives the weights
    config.parallelism.spmd_backend = "partial_dtensor"  # spmd_types' checks need device-side types
    config.lr_scheduler = LRSchedulersContainer.Config(**peer_lr_schedule(args.warmup_steps, steps, args.lr_min))
    config.activation_checkpoint = None  # the project's debug config: no AC
    config.validator.enable = False
    config.metrics.enable_tensorboard = False
    config.metrics.log_freq = 1
    config.profiler.enable_profiling = False
    config.checkpoint.enable = bool(args.init_hf)
    config.checkpoint.folder = str(work / "peer_ckpt")
    config.checkpoint.interval = 10**6
    config.checkpoint.initial_load_path = args.init_hf
    config.checkpoint.initial_load_in_hf = bool(args.init_hf)
    config.checkpoint.load_only = True  # the initial weights only: no checkpoint is written
    return config


class ReplayWindows:
    """This rank's windows, step by step, as the peer's loader yields them: ({"input": x}, labels)."""

    def __init__(self, path: str, rank: int):
        self.windows = torch.load(path)[:, rank]  # [steps, batch, seq + 1]

    def __iter__(self):
        for w in self.windows:
            yield {"input": w[:, :-1].contiguous()}, w[:, 1:].contiguous()

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def instrument(trainer: Any, records: list[dict]) -> None:
    """Stamp wall and CPU time at the start of every step; keep the loss, grad norm and lr it logs."""
    step_fn, log_fn = trainer.train_step, trainer.metrics_processor.log

    def train_step(data_iterator):
        records.append({**stamp(),
                        "lr": trainer.lr_schedulers.schedulers[0].get_last_lr()[0]})
        return step_fn(data_iterator)

    def log(step, loss, max_loss, grad_norm, *a, **k):
        records[-1].update(loss=float(loss), grad_norm=float(grad_norm))
        return log_fn(step, loss, max_loss, grad_norm, *a, **k)

    trainer.train_step, trainer.metrics_processor.log = train_step, log


def run_cpu(args: argparse.Namespace) -> None:
    """Build the peer's Trainer for this shape, replay the windows, train, write the records."""
    windows = torch.load(args.windows)
    steps, _, batch, seq = windows.shape[0], windows.shape[1], windows.shape[2], windows.shape[3] - 1
    work = Path(args.out)
    rank = int(os.environ.get("RANK", "0"))
    config = build_config(args, batch, seq, steps, work)
    trainer = config.build()
    trainer.dataloader = ReplayWindows(args.windows, rank)
    records: list[dict] = []
    instrument(trainer, records)
    try:
        with _maybe_profile(args.profile_dir, rank):
            trainer.train()
        records.append(stamp())
    finally:
        trainer.close()
    (work / f"peer_rank{rank}.json").write_text(json.dumps(records))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _maybe_profile(folder: str | None, rank: int):
    """A CPU profile of the whole run on rank 0 (the driver asks for it at one shape only)."""
    import contextlib

    if not folder or rank != 0:
        return contextlib.nullcontext()
    return ProfileToFile(Path(folder) / "peer_profile.txt")


class ProfileToFile:
    def __init__(self, path: Path):
        self.path, self.prof = path, torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])

    def __enter__(self):
        self.prof.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.prof.__exit__(*exc)
        self.path.write_text(self.prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
