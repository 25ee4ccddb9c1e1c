"""Shared pieces of the checkpoint tests: building trainers in rank processes and reading checkpoints back."""

from __future__ import annotations

import hashlib
import random
import shutil
import warnings
from pathlib import Path

import conftest
import torch
from conftest import DEBUG_CONFIG, SHIPPED_TOKENIZER
from torch.distributed.tensor import DTensor

DEBUG = DEBUG_CONFIG

FSDP2 = ["--parallelism.data_parallel_shard_degree=2", "--training.batch_size=2"]
DDP2 = ["--parallelism.data_parallel_replicate_degree=2", "--parallelism.data_parallel_shard_degree=1",
        "--training.batch_size=2"]
HSDP4 = ["--parallelism.data_parallel_replicate_degree=2", "--parallelism.data_parallel_shard_degree=2",
         "--training.batch_size=1"]


def make_trainer(dump: str, *overrides: str):
    return conftest.make_trainer(dump, "--metrics.log_freq=100", "--training.deterministic",
                                 "--checkpoint.enable_checkpoint", "--lr_scheduler.warmup_steps=2", *overrides)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def full_model_digests(trainer, dtype: torch.dtype | None = None) -> dict[str, str]:
    """sha256 of every parameter's full value, optionally cast to ``dtype`` (a collective: every rank calls it)."""
    out = {}
    for part in trainer.model_parts:
        for fqn, param in part.named_parameters():
            value = param.detach()
            value = value.full_tensor() if isinstance(value, DTensor) else value
            out[fqn] = digest(value if dtype is None else value.to(dtype))
    return out


def full_optimizer_digests(trainer) -> dict[str, str]:
    """sha256 of every optimizer state tensor's full value, keyed 'fqn/name' (a collective)."""
    from torchtitan.checkpoint import model_view

    view = model_view(trainer.model_parts)
    names = {id(p): fqn for fqn, p in view.named_parameters()}
    out = {}
    for param, state in trainer.optimizer.state.items():
        for key, value in sorted(state.items()):
            if isinstance(value, DTensor):
                value = value.full_tensor()
            out[f"{names[id(param)]}/{key}"] = digest(value)
    return out


def checkpoint_tensors(path: Path, prefix: str) -> dict[str, torch.Tensor]:
    """Every tensor under ``prefix`` in a checkpoint, read in full on this process (no process group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from torchtitan.checkpoint.store import read_dcp_metadata

    md = read_dcp_metadata(path)
    template = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
                for k, m in md.state_dict_metadata.items()
                if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(template, checkpoint_id=str(path), no_dist=True)
    return template


def copy_checkpoint(src_dump: Path, step: int, dst_dump: Path) -> Path:
    """Copy one committed checkpoint into a fresh dump folder, as a stopped run would have left it."""
    dst = dst_dump / "checkpoint" / f"step-{step}"
    shutil.copytree(src_dump / "checkpoint" / f"step-{step}", dst)
    return dst


def train(rank: int, world_size: int, dump: str, overrides: list[str]) -> dict:
    trainer = make_trainer(dump, *overrides)
    losses = trainer.train()
    return {"losses": losses, "step": trainer.step, "weights": full_model_digests(trainer),
            "weights_bf16": full_model_digests(trainer, torch.bfloat16), "rng_after": rng_draws()}


def rng_draws() -> tuple[list[float], float]:
    """Numbers drawn from this rank's torch and Python generators: equal only if their states are equal."""
    return torch.rand(3).tolist(), random.random()


def resume_and_inspect(rank: int, world_size: int, dump: str, overrides: list[str]) -> dict:
    """Load the checkpoint in ``dump``, record what was loaded, then train on from it."""
    trainer = make_trainer(dump, *overrides)
    step = trainer.checkpointer.load()
    loaded = {"step": step, "model": full_model_digests(trainer), "optimizer": full_optimizer_digests(trainer),
              "data": trainer.dataloader.dataset.state_dict()}
    return {**train_loaded(trainer), "loaded": loaded}


def train_loaded(trainer) -> dict:
    losses = trainer.train()  # loads the same checkpoint again, then trains
    return {"losses": losses, "step": trainer.step, "weights": full_model_digests(trainer), "rng_after": rng_draws()}


def checkpoint_digests(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """(model, optimizer) digests of a checkpoint's tensors, keyed like the helpers above."""
    model = {k[len("model."):]: digest(v) for k, v in checkpoint_tensors(path, "model.").items()}
    optim = {}
    for key, value in checkpoint_tensors(path, "optimizer.state.").items():
        fqn, _, name = key[len("optimizer.state."):].rpartition(".")
        optim[f"{fqn}/{name}"] = digest(value)
    return model, optim


def hf_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' own logits for a saved Hugging Face model, in float32."""
    import transformers  # a test-only dependency (the dev extra)

    model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def reference_batch(global_batch: int, seq_len: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """The first global batch the trainer sees (the stream does not depend on the DP degree)."""
    from torchtitan.datasets import DataLayout, build_dataloader, build_tokenizer

    loader = build_dataloader(dataset_name="embedded", dataset_path=None, tokenizer=build_tokenizer(SHIPPED_TOKENIZER),
                              layout=DataLayout(seq_len, global_batch, 0, 1))
    return next(iter(loader))


def hf_loss(folder: Path, global_batch: int, seq_len: int = 32) -> float:
    """transformers' loss on that batch: what the trainer's step-1 loss must equal."""
    inputs, labels = reference_batch(global_batch, seq_len)
    logits = hf_logits(folder, inputs)
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1).double(), labels.flatten()))
