#!/usr/bin/env python
"""Train the small SentencePiece BPE tokenizer shipped with the project.

The model is trained with SentencePiece's own trainer on the embedded corpus
(CPython's documentation, see ``torchtitan/datasets/embedded_corpus.py``) or
on a user-supplied JSON-lines / plain-text file.  The settings follow the
Llama 2 recipe at a toy scale: BPE, byte fallback (so every string encodes,
with no <unk> in practice), digits split into single characters, no
whitespace normalization (so decode(encode(text)) == text), and the special
ids unk=0, bos=1, eos=2, no pad.

Regenerate the shipped model from the repository root with:

    python scripts/train_tokenizer.py

Training is deterministic for a given corpus: one thread, no sentence
sampling or shuffling, and a fixed random seed.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# Running `python scripts/train_tokenizer.py` puts scripts/ (not the repo
# root) on sys.path; add the root so the torchtitan package is importable.
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import sentencepiece as spm  # noqa: E402

from torchtitan.datasets.embedded_corpus import ensure_embedded_corpus  # noqa: E402

DEFAULT_OUTPUT = REPO_ROOT / "torchtitan" / "datasets" / "assets" / "tokenizer.model"
SEED = 1234


def iter_documents(path: str) -> Iterator[str]:
    """Yield documents from a JSON-lines file (field "text") or a plain-text file."""
    if path.endswith((".jsonl", ".json")):
        with open(path, encoding="utf-8") as f:
            for line_number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                record = json.loads(line)
                if "text" not in record:
                    raise ValueError(f"{path}:{line_number}: JSON object has no 'text' field")
                yield record["text"]
    else:
        with open(path, encoding="utf-8") as f:
            yield f.read()


def iter_sentences(path: str) -> Iterator[str]:
    """SentencePiece trains on "sentences"; use the non-blank lines of every document.

    Newlines themselves are never seen by the trainer; at encode time they
    fall back to the byte piece <0x0A>, exactly as in Llama 2.
    """
    for document in iter_documents(path):
        for line in document.splitlines():
            if line.strip():
                yield line


def train(input_path: str, output_path: Path, vocab_size: int) -> None:
    spm.set_random_generator_seed(SEED)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter_sentences(input_path),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        # Special ids as in Llama 2; no padding token.
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        byte_fallback=True,
        split_digits=True,
        # Keep text exactly as written (indentation, newlines via bytes) so
        # decoding reproduces the input.
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        character_coverage=0.9995,
        max_sentence_length=16384,
        # Determinism: use every sentence in file order, on one thread.
        input_sentence_size=0,
        shuffle_input_sentence=False,
        num_threads=1,
        minloglevel=2,
    )
    output_path.parent.mkdir(parents=True, exist_ok=True)
    # Atomic publish, so a concurrently starting job never reads half a model.
    fd, tmp_name = tempfile.mkstemp(prefix=output_path.name + ".", suffix=".tmp", dir=output_path.parent)
    with os.fdopen(fd, "wb") as f:
        f.write(model.getvalue())
    os.chmod(tmp_name, 0o644)
    os.replace(tmp_name, output_path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=2048, help="total vocabulary size (default: 2048)")
    parser.add_argument(
        "--output",
        type=Path,
        default=DEFAULT_OUTPUT,
        help="where to write the model (default: torchtitan/datasets/assets/tokenizer.model in the repo)",
    )
    parser.add_argument(
        "--input",
        default=None,
        help="training text: a .jsonl/.json file with a 'text' field per line, or a plain-text file "
        "(default: the embedded CPython documentation corpus)",
    )
    args = parser.parse_args(argv)
    if args.vocab_size < 300:
        # 256 byte pieces + 3 specials must fit, plus room for real merges.
        parser.error("--vocab-size must be at least 300 with byte fallback enabled")

    input_path = args.input if args.input is not None else ensure_embedded_corpus()
    if not os.path.isfile(input_path):
        parser.error(f"--input {input_path!r} does not exist")

    start = time.perf_counter()
    try:
        train(input_path, args.output, args.vocab_size)
    except RuntimeError as e:
        # The floor depends on the corpus (its characters, the 256 byte pieces and the specials): SentencePiece
        # finds it only while training and says so in a C++ assertion; name the option and the size it needs.
        needed = re.search(r"Vocabulary size is smaller than required_chars\. \d+ vs (\d+)", str(e))
        if needed is None:
            raise
        floor = needed.group(1)
        parser.error(f"--vocab-size {args.vocab_size} is too small for {input_path}: its characters, the 256 byte "
                     f"pieces and the 3 specials need at least {floor}; give --vocab-size >= {floor}")
    elapsed = time.perf_counter() - start
    size = args.output.stat().st_size
    print(f"wrote {args.output} ({size} bytes, vocab {args.vocab_size}) from {input_path} in {elapsed:.1f}s")


if __name__ == "__main__":
    main()
