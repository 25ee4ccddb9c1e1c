"""Data pipeline: embedded default corpus, tokenizers (SentencePiece, Llama 3 tiktoken, Hugging Face), token stores and their loaders."""

from torchtitan.datasets.embedded_corpus import ensure_embedded_corpus
from torchtitan.datasets.hf_datasets import (
    DATASETS, DatasetSpec, build_dataloader, build_validation_dataset, check_training_data,
    open_validation_store,
)
from torchtitan.datasets.split import HeldOutSplit
from torchtitan.datasets.tokenizer import Tokenizer, build_tokenizer

__all__ = [
    "DATASETS",
    "DatasetSpec",
    "HeldOutSplit",
    "Tokenizer",
    "build_dataloader",
    "build_validation_dataset",
    "check_training_data",
    "open_validation_store",
    "build_tokenizer",
    "ensure_embedded_corpus",
]
