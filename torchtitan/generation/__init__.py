"""Sampling from a model of any format the project reads (``scripts/generate.py``; docs/generation.md).

``loading`` finds the format, the family and the tokenizer and loads the weights (one process, or
tensor parallel); ``decode`` runs the batched loop with a KV cache; ``sampling`` picks each token;
``run`` ties them together for a list of prompts.
"""

from torchtitan.generation.decode import Decoded, decode
from torchtitan.generation.loading import Loaded, Source, checkpoint_format, describe, load
from torchtitan.generation.run import Output, generate, prompt_ids
from torchtitan.generation.sampling import Sampling, filter_logits, next_tokens

__all__ = ["Decoded", "Loaded", "Output", "Sampling", "Source", "checkpoint_format", "decode", "describe",
           "filter_logits", "generate", "load", "next_tokens", "prompt_ids"]
