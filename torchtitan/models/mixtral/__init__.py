"""The Mixtral family (``--model.name=mixtral``): Llama attention and 8 SwiGLU experts, top-2, on the shared
decoder (``models/common/decoder.py``). ``spec.py`` registers it."""
