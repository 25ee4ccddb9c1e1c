"""The one decoder every family configures: its arguments protocol (``config``), the model (``decoder``),
the Qwen3/Mixtral arguments (``args``), FLOP counts (``flops``), parallelism and preflight checks
(``parallel``), Hugging Face names and configs (``weight_map``, ``hf``, ``hf_config``) and the spec built
from them (``decoder_spec``). No family is imported here."""
