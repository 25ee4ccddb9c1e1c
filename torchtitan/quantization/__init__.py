"""Model converters: rewrites of a built model (on the meta device) that run between build and parallelize.

``--model.converters float8`` swaps linears for torchao's Float8 training linears (``float8.py``)
and, on CUDA, routes the MoE experts through FP8 grouped GEMMs (``models/moe/float8_experts.py``); what a job
asks of them is checked before any process group (``checks.py``), and checkpoints see plain tensors
(``float8_state.py``). docs/float8.md.
"""

from torchtitan.quantization.converters import CONVERTERS, apply_converters, converter_problems

__all__ = ["CONVERTERS", "apply_converters", "converter_problems"]
