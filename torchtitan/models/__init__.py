"""Model families behind one registry keyed by ``--model.name`` (registry.py); what a family provides is
``spec.py``'s ``ModelSpec``. Code outside ``models/<family>/`` imports from here, never a family."""

from torchtitan.models.attention import describe_backend
from torchtitan.models.common.config import DecoderConfig
from torchtitan.models.registry import (
    get_model_spec,
    is_flavor_path,
    model_args,
    model_flavors,
    model_names,
    register_model_spec,
    spec_for_args,
)

__all__ = ["DecoderConfig", "describe_backend",
           "get_model_spec", "is_flavor_path", "model_args", "model_flavors", "model_names", "register_model_spec",
           "spec_for_args"]
