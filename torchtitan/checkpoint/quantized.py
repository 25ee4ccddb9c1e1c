"""Quantized Hugging Face releases: which ones load, and their dequantization on load.

DeepSeek-V3's (and Kimi K2's) FP8 releases state ``quantization_config`` ``{"quant_method": "fp8",
"fmt": "e4m3", "weight_block_size": [128, 128]}``: a quantized weight ``W`` [out, in] is stored as
float8_e4m3fn beside ``W_scale_inv`` [ceil(out / 128), ceil(in / 128)] float32, and its value is each
128 x 128 block times its scale. Tensors without a ``_scale_inv`` (norms, the router, embeddings) are
stored plainly; a float8 tensor without one has no value and is refused in one line naming it and the
missing scale (``formats.HFSource.float8_problem``). A family's adapter may dequantize a method of its own
(``StateDictAdapter.quant_methods``: GPT-OSS's MXFP4 experts). Anything else is refused in one
line: loading it as if plain would train on garbage.
"""

from __future__ import annotations

from collections.abc import Container, Mapping

import torch

SCALE_SUFFIX = "_scale_inv"


def fp8_block_size(config: Mapping[str, object], family_methods: Container[str] = ()) -> tuple[int, int] | None:
    """The (rows, cols) block of a release's FP8 weights; None: not quantized, or quantized by a method in
    ``family_methods`` (the family's adapter dequantizes it: GPT-OSS's MXFP4); ValueError (one line) when the
    quantization is one this project cannot dequantize."""
    quant = config.get("quantization_config")
    if not quant:
        return None
    if not isinstance(quant, Mapping):
        raise ValueError(f"quantization_config {quant!r} is not an object")
    method, fmt, block = quant.get("quant_method"), quant.get("fmt", "e4m3"), quant.get("weight_block_size")
    if isinstance(method, str) and method in family_methods:
        return None
    if (method != "fp8" or fmt != "e4m3" or not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"quantization_config (quant_method {method!r}, fmt {fmt!r}, weight_block_size {block!r}) "
                         "is not supported: only fp8 e4m3 with a 2-D weight_block_size dequantizes on load; "
                         "dequantize the release first")
    return block[0], block[1]


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 ``weight * scale_inv`` with each scale spread over its ``block`` (the last blocks may be partial)."""
    rows, cols = weight.shape
    scales = scale_inv.float().repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]
    return weight.float() * scales
