"""The GPT-OSS family (``--model.name=gpt_oss``): attention with sinks, biases and sliding windows, and biased
experts with the clamped SwiGLU, on the shared decoder (``models/common/decoder.py``). ``spec.py`` registers it."""
