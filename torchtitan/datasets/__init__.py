"""Data pipeline: embedded default corpus, tokenizers (SentencePiece, Llama 3 tiktoken, Hugging Face), packing dataloader."""

from torchtitan.datasets.embedded_corpus import ensure_embedded_corpus
from torchtitan.datasets.hf_datasets import (
    DATASETS, DatasetSpec, PackedTextDataset, build_dataloader, build_validation_dataset, check_training_data,
    count_windows,
)
from torchtitan.datasets.split import HeldOutSplit
from torchtitan.datasets.tokenizer import Tokenizer, build_tokenizer

__all__ = [
    "DATASETS",
    "DatasetSpec",
    "HeldOutSplit",
    "PackedTextDataset",
    "Tokenizer",
    "build_dataloader",
    "build_validation_dataset",
    "check_training_data",
    "count_windows",
    "build_tokenizer",
    "ensure_embedded_corpus",
]
