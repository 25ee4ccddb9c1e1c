from torchtitan.models.llama3.args import ModelArgs, llama3_flavors
from torchtitan.models.llama3.model import InitSpec, Transformer, apply_init_spec, flops_per_token

__all__ = ["InitSpec", "ModelArgs", "Transformer", "apply_init_spec", "flops_per_token", "llama3_flavors"]
