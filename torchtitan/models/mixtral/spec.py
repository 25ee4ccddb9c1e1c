"""Mixtral's ``ModelSpec`` (``--model.name=mixtral``). A Mixtral Hugging Face folder works as
``--model.flavor DIR``."""

from __future__ import annotations

from pathlib import Path

from torchtitan.models.common import hf_config
from torchtitan.models.common.decoder_spec import decoder_model_spec
from torchtitan.models.common.hf import MIXTRAL_NAMING
from torchtitan.models.mixtral.args import MixtralArgs, mixtral_flavors
from torchtitan.models.registry import register_model_spec

ARCHITECTURES = ("MixtralForCausalLM",)


def read_release(path: str | Path) -> MixtralArgs:
    return hf_config.args_from_release(path, MixtralArgs, ARCHITECTURES, ("mixtral",), qwen=False)


def _hf_config(args: MixtralArgs, **kw) -> dict:  # noqa: ANN003 - bos_id, eos_id, dtype
    return hf_config.hf_config(args, architecture=ARCHITECTURES[0], model_type="mixtral", qwen=False, **kw)


SPEC = decoder_model_spec("mixtral", MixtralArgs, mixtral_flavors, read_release, MIXTRAL_NAMING, _hf_config,
                          qwen=False)
register_model_spec(SPEC)
