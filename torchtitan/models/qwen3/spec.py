"""Qwen3's ``ModelSpec`` (``--model.name=qwen3``): dense Qwen3 and Qwen3-MoE on the shared decoder.

A Qwen3 or Qwen3-MoE Hugging Face folder works as ``--model.flavor DIR``.
"""

from __future__ import annotations

from pathlib import Path

from torchtitan.models.common import hf_config
from torchtitan.models.common.decoder_spec import decoder_model_spec
from torchtitan.models.common.hf import QWEN3_NAMING
from torchtitan.models.qwen3.args import Qwen3Args, qwen3_flavors
from torchtitan.models.registry import register_model_spec

ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


def read_release(path: str | Path) -> Qwen3Args:
    return hf_config.args_from_release(path, Qwen3Args, ARCHITECTURES, ("qwen3", "qwen3_moe"), qwen=True)


def _hf_config(args: Qwen3Args, **kw) -> dict:  # noqa: ANN003 - bos_id, eos_id, dtype
    moe = bool(args.num_experts)
    return hf_config.hf_config(args, architecture=ARCHITECTURES[moe], model_type="qwen3_moe" if moe else "qwen3",
                               qwen=True, **kw)


SPEC = decoder_model_spec("qwen3", Qwen3Args, qwen3_flavors, read_release, QWEN3_NAMING, _hf_config, qwen=True)
register_model_spec(SPEC)
