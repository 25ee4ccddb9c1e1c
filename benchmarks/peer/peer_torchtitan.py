"""Run the peer, the `torchtitan` package from PyPI, on the shapes gpu_throughput.py measures.

    PEER_SITE=/path/to/site-packages python benchmarks/peer/peer_torchtitan.py --layers 4 --seq 8192 \
        --steps 20 --warmup 5 [--compile] [--sac]

On CPU (``--device cpu``) it is one side of ``peer_cpu_compare.py``, which installs the peer,
launches this script under ``torchrun`` and documents the CPU workarounds (``peer_cpu.py``,
``peer_cpu_patches.py``). What follows describes the GPU run.

It runs the peer's own Trainer on its Llama 3 8B config cut to ``--layers`` blocks, batch 1,
bf16 FSDP mixed precision on one GPU: 0.3.x through its Python config registry, 0.2.x through
its command line (with the 8B flavor's layer count patched before the model is built). gpu_throughput.py reads
the peer's own per-step log lines (tokens/s, memory) with ``parse_step_lines``.

The peer and this project share the package name ``torchtitan``, so this script never
imports the project: run it in its own process with the peer first on ``sys.path``
(``PEER_SITE``). The peer reads text and a tokenizer from disk; both are made here in a
temporary folder (a small BPE trained with ``tokenizers`` on generated text), because
the token ids only feed an embedding lookup: the throughput does not depend on them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path


def _peer_first_on_path() -> None:
    """The project's checkout must not shadow the peer's package of the same name."""
    here = Path(__file__).resolve()
    # The repository, benchmarks/ and benchmarks/peer/: none may come before the peer's package.
    ours = {str(here.parents[2]), str(here.parents[1]), str(here.parent), str(Path(__file__).parent)}
    sys.path[:] = [p for p in sys.path if p not in ("", ".") and p not in ours]
    if os.environ.get("PEER_SITE"):
        sys.path.insert(0, os.environ["PEER_SITE"])


def make_assets(root: Path) -> tuple[Path, Path]:
    """A tokenizer folder (tokenizer.json + tokenizer_config.json) and a c4-style jsonl text set."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    words = [f"w{i}" for i in range(2000)]
    lines = [" ".join(words[(i * 37 + j * 11) % len(words)] for j in range(400)) for i in range(400)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=4000, special_tokens=["<unk>", "<bos>", "<eos>"]))
    tok_dir = root / "tokenizer"
    tok_dir.mkdir(parents=True)
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>"}))
    data_dir = root / "c4_test"
    data_dir.mkdir()
    # Not "c4_test.json": `datasets` reads a split name out of a file name ("test"), and the peer asks for "train".
    with open(data_dir / "data.json", "w") as f:
        for line in lines:
            f.write(json.dumps({"text": line}) + "\n")
    return tok_dir, data_dir


def _load_beside(name: str):
    """A module of this folder, loaded by file path: the folder itself is off ``sys.path`` here."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: the debug-shape comparison, run by peer_cpu_compare.py under torchrun")
    p.add_argument("--layers", type=int)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--sac", action="store_true")
    patches = _load_beside("peer_cpu_patches")
    cpu = _load_beside("peer_cpu")
    cpu.add_cpu_args(p)
    args = p.parse_args()
    _peer_first_on_path()
    if args.device == "cpu":
        patches.apply_before_import()  # before the peer's first import: it reads the device then
        import torchtitan  # noqa: F401

        patches.apply_after_import()
        cpu.run_cpu(args)
        return
    if args.layers is None:
        p.error("--layers is required on the GPU")
    main_gpu(args)


def main_gpu(args: argparse.Namespace) -> None:
    import torch

    import torchtitan

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29600 + os.getpid() % 1000))
    work = Path(tempfile.mkdtemp(prefix="peer_"))
    tok_dir, data_dir = make_assets(work)
    try:
        import torchtitan.models.llama3.config_registry  # noqa: F401  (0.3: Python config registry)
        run_03(args, tok_dir, data_dir, work)
    except ModuleNotFoundError as e:
        if "config_registry" not in str(e):
            raise
        run_02(args, tok_dir, data_dir, work)  # 0.2: TOML/CLI JobConfig
    print("PEER " + json.dumps({
        "peer_version": getattr(torchtitan, "__version__", "?"),
        "torch_peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
    }), flush=True)


def run_03(args, tok_dir: Path, data_dir: Path, work: Path) -> None:
    import torch

    from torchtitan.config import CompileConfig
    from torchtitan.distributed.activation_checkpoint import SelectiveAC
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.models.llama3.config_registry import llama3_8b
    from torchtitan.tools.logging import init_logger

    init_logger()
    config = llama3_8b()
    config.model_spec.model.layers = config.model_spec.model.layers[: args.layers]
    config.hf_assets_path = str(tok_dir)
    config.dump_folder = str(work / "out")
    config.dataloader = HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=str(data_dir))
    config.training.seq_len = args.seq
    config.training.local_batch_size = 1
    config.training.steps = args.warmup + args.steps
    config.profiler.enable_profiling = False
    config.metrics.enable_tensorboard = False
    config.metrics.log_freq = 1
    config.checkpoint.enable = False
    config.validator.enable = False
    config.compile = CompileConfig(enable=args.compile, components=["model", "loss"])
    if not args.sac:
        config.activation_checkpoint = None
    elif not isinstance(config.activation_checkpoint, SelectiveAC.Config):
        config.activation_checkpoint = SelectiveAC.Config()
    trainer = config.build()
    try:
        trainer.train()
    finally:
        trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def run_02(args, tok_dir: Path, data_dir: Path, work: Path) -> None:
    import torch

    from torchtitan.config import ConfigManager
    from torchtitan.models.llama3 import llama3_args
    from torchtitan.tools.logging import init_logger
    from torchtitan.train import Trainer

    init_logger()
    llama3_args["8B"].n_layers = args.layers
    argv = [
        "--model.name", "llama3", "--model.flavor", "8B",
        "--model.hf_assets_path", str(tok_dir), "--job.dump_folder", str(work / "out"),
        "--training.dataset", "c4_test", "--training.dataset_path", str(data_dir),
        "--training.local_batch_size", "1", "--training.seq_len", str(args.seq),
        "--training.steps", str(args.warmup + args.steps), "--metrics.log_freq", "1",
        "--activation_checkpoint.mode", "selective" if args.sac else "none",
        "--activation_checkpoint.selective_ac_option", "op",
    ] + (["--compile.enable"] if args.compile else [])  # 0.2.x compiles the model and the loss by default
    # The arguments are handed over, not put in sys.argv: 0.2.x's ConfigManager.parse_args takes
    # sys.argv[1:] as a default bound when its module is imported, before this runs.
    config = ConfigManager().parse_args(argv)
    trainer = Trainer(config)
    try:
        trainer.train()
    finally:
        trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def parse_step_lines(text: str, warmup: int) -> dict:
    """Median tokens/s and peak memory from the peer's per-step log lines (log_freq 1)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    tps, mem = [], []
    for m in re.finditer(r"step:\s*(\d+).*?memory:\s*([\d.]+)\s*GiB.*?tps:\s*([\d,]+)", text):
        if int(m.group(1)) > warmup:
            mem.append(float(m.group(2)))
            tps.append(float(m.group(3).replace(",", "")))
    if not tps:
        raise ValueError("no step lines with tps after warm-up in the peer's output")
    return {"tokens_per_s": statistics.median(tps), "steps_timed": len(tps), "peak_mem_gib": max(mem)}


if __name__ == "__main__":
    main()
