"""Data pipeline: embedded default corpus, tokenizers (SentencePiece, Llama 3 tiktoken, Hugging Face), token stores
and their loaders.

Modules, each importing only those before it: ``split`` and ``tokenizer``
(leaves), ``sources`` (registry, local readers, fingerprints), ``token_store``
(reading a prepared store), ``prepare`` (writing one), ``store_cache`` (prepare on
first use, under a lock), ``window_order``, ``interleave`` (which source each sample of a
weighted mixture comes from), ``layout`` (``DataLayout``: one rank's share, which every dataset
and loader takes), the datasets (``store_dataset``, ``mixture``,
``stream_dataset``) and ``loaders``, the run's entry points.
"""

from torchtitan.datasets.embedded_corpus import ensure_embedded_corpus
from torchtitan.datasets.layout import DataLayout
from torchtitan.datasets.loaders import (
    build_dataloader,
    build_validation_dataset,
    check_training_data,
    open_validation_store,
)
from torchtitan.datasets.sources import DATASETS, DatasetSpec, TokenStoreError
from torchtitan.datasets.split import HeldOutSplit
from torchtitan.datasets.tokenizer import Tokenizer, build_tokenizer

__all__ = [
    "DATASETS",
    "DataLayout",
    "DatasetSpec",
    "HeldOutSplit",
    "TokenStoreError",
    "Tokenizer",
    "build_dataloader",
    "build_validation_dataset",
    "check_training_data",
    "open_validation_store",
    "build_tokenizer",
    "ensure_embedded_corpus",
]
