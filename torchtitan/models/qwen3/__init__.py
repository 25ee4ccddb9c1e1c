"""The Qwen3 family (``--model.name=qwen3``): dense Qwen3 and Qwen3-MoE, on the shared decoder
(``models/common/decoder.py``). ``spec.py`` registers it."""
