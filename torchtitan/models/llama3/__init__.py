"""The Llama 3 family (``--model.name=llama3``): its flavors and arguments (``args``), its release reader
(``release``, ``convert``) and Meta's format (``adapter``); the model is the shared decoder
(``models/common/decoder.py``). ``spec.py`` registers it."""

from torchtitan.models.llama3.args import ModelArgs, ffn_hidden_dim, llama3_flavors

__all__ = ["ModelArgs", "ffn_hidden_dim", "llama3_flavors"]
