"""What both trainers of the CPU comparison read: one tokenizer, one token store, one set of
initial weights, and the token windows of every rank at every step.

Made once per driver run in a work folder (``peer_cpu_compare.py --work``; reused when present):

* ``tokenizer/``: a byte-pair tokenizer.json of the debug model's 2048 words, trained on a
  generated corpus, with its tokenizer_config.json (BOS/EOS names the peer reads);
* ``corpus/corpus.jsonl``: that corpus (the peer builds its own loader from it, then the
  windows below replace that loader);
* ``store/``: the corpus tokenized by ``scripts/prepare_data.py`` (what the project trains on);
* ``init_hf/``: the project's initial weights (seed 42, a seed checkpoint), exported in Hugging
  Face format in float32, which both trainers load;
* ``windows_<ranks>x<batch>x<seq>_<steps>.pt``: the project loader's windows for every data
  rank and step, ``[steps, ranks, batch, seq + 1]`` int64, which the peer replays.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from common import REPO

VOCAB = 2048  # the debug model's vocabulary
SEED = 42


def make_tokenizer_and_corpus(work: Path, documents: int = 600, words_per_doc: int = 400) -> None:
    """A reproducible corpus of made-up words and a BPE tokenizer of exactly ``VOCAB`` entries."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    words = [f"w{i}" for i in range(3000)]
    lines = [" ".join(words[(i * 37 + j * 11 + (i * j) % 7) % len(words)] for j in range(words_per_doc))
             for i in range(documents)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["<unk>", "<|begin_of_text|>", "<|end_of_text|>"]
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials))
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    (work / "tokenizer").mkdir(parents=True, exist_ok=True)
    tok.save(str(work / "tokenizer" / "tokenizer.json"))
    (work / "tokenizer" / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": specials[1], "eos_token": specials[2]}))
    (work / "corpus").mkdir(exist_ok=True)
    with open(work / "corpus" / "corpus.jsonl", "w") as f:
        for line in lines:
            f.write(json.dumps({"text": line}) + "\n")


def _run(cmd: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    subprocess.run(cmd, check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL)


def make_store_and_weights(work: Path) -> None:
    """The token store, then a seed checkpoint of the debug model exported as a float32 HF folder."""
    tokenizer = str(work / "tokenizer" / "tokenizer.json")
    _run([sys.executable, "scripts/prepare_data.py", str(work / "corpus" / "corpus.jsonl"), str(work / "store"),
          "--tokenizer", tokenizer, "--workers", "1", "--no-progress"])
    _run(["bash", "scripts/create_seed_checkpoint.sh", f"--job.dump_folder={work / 'seed'}",
          f"--model.tokenizer_path={tokenizer}", f"--training.seed={SEED}",
          "--metrics.enable_tensorboard=false", "--checkpoint.enable_checkpoint=true"])
    _run([sys.executable, "scripts/export_checkpoint.py", str(work / "seed" / "checkpoint" / "step-0"),
          str(work / "init_hf"), "--format", "hf", "--dtype", "float32"])


def prepare(work: Path) -> None:
    """Everything above that is not in ``work`` yet."""
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "tokenizer" / "tokenizer.json").is_file():
        make_tokenizer_and_corpus(work)
    if not (work / "init_hf").is_dir():
        make_store_and_weights(work)


def windows_path(work: Path, ranks: int, batch: int, seq: int, steps: int) -> Path:
    return work / f"windows_{ranks}x{batch}x{seq}_{steps}.pt"


def dump_windows(work: Path, ranks: int, batch: int, seq: int, steps: int) -> Path:
    """The windows the project's loader gives each data rank at each step (its own code, its order), saved."""
    import torch

    path = windows_path(work, ranks, batch, seq, steps)
    if not path.is_file():
        windows = loader_windows(str(work / "tokenizer" / "tokenizer.json"), str(work / "store"), ranks, batch, seq,
                                 steps)
        torch.save(windows, path)
    return path


def loader_windows(tokenizer_path: str, dataset_path: str | None, ranks: int, batch: int, seq: int, steps: int):
    """``[steps, ranks, batch, seq + 1]`` int64: each data rank's inputs with the last label, step by step, from
    the project's loader of ``dataset_path`` (None: the embedded corpus)."""
    import torch

    from torchtitan.datasets import DataLayout, build_dataloader
    from torchtitan.datasets.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(tokenizer_path)
    per_rank = []
    for rank in range(ranks):
        loader = build_dataloader(dataset_name="embedded", dataset_path=dataset_path, tokenizer=tokenizer,
                                  layout=DataLayout(seq, batch, rank, ranks))
        it = iter(loader)
        batches = [next(it) for _ in range(steps)]
        per_rank.append(torch.stack([torch.cat([x, y[:, -1:]], dim=1) for x, y in batches]))
    return torch.stack(per_rank, dim=1).contiguous()
