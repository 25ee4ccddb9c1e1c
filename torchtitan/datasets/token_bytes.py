"""How many UTF-8 bytes of text each token stands for: what bits per byte divides by.

Bits per byte (``loss / ln 2`` per byte of the text scored) compares models whose tokenizers
differ, which a loss per token cannot. The table is exact for the project's SentencePiece
tokenizer and for tiktoken (``Tokenizer.byte_lengths``). A Hugging Face tokenizer is measured
by decoding each token alone, which is exact for whole characters and counts a byte-level
token that holds part of one as the 3 bytes of the replacement character. SentencePiece's
dummy prefix (the space it adds before a text's first word) counts as a byte of the text.
"""

from __future__ import annotations

import torch

from torchtitan.datasets.tokenizer import Tokenizer


def token_byte_lengths(tokenizer: Tokenizer) -> torch.Tensor:
    """``[n_words]`` int64: the UTF-8 bytes of text each token id stands for."""
    return torch.tensor(tokenizer.byte_lengths(), dtype=torch.long)
