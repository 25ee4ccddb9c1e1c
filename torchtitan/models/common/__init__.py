"""The one decoder every family configures: its arguments protocol (``config``), the model (``decoder``, whose
class is a family's ``ModelSpec.model`` or its base), the Qwen3/Mixtral arguments (``args``), FLOP counts
(``flops``), parallelism and preflight checks (``parallel``) and Hugging Face names and configs (``weight_map``,
``hf``, ``hf_config``). No family is imported here."""
