"""The Qwen3 family (``--model.name=qwen3``): dense Qwen3 and Qwen3-MoE, on the shared decoder
(``models/common/moe_decoder.py``). ``spec.py`` registers it."""
