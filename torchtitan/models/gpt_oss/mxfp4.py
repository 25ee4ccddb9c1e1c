"""MXFP4 (OCP microscaling, 4-bit floats in blocks of 32 sharing a power-of-two scale): how GPT-OSS releases
store their experts' weights, as ``<name>_blocks`` [..., G, 16] uint8 and ``<name>_scales`` [..., G] uint8.

Each byte of a block holds two E2M1 values, the low nibble first; a scale byte ``s`` is the
exponent ``2 ** (s - 127)`` of its block of 32 values. Dequantized, the last two dims merge into
``G * 32`` values per row.
"""

from __future__ import annotations

import torch

from torchtitan.models.common.weight_map import PackedFormat

# E2M1: sign, two exponent bits, one mantissa bit; the 16 codes in order.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``blocks [..., G, 16]`` uint8 and ``scales [..., G]`` uint8 -> ``[..., G * 32]`` in ``dtype``."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair: blocks "
                         "must be [..., G, 16] with scales [..., G]")
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = blocks.to(torch.uint8)
    values = torch.stack([table[(codes & 0x0F).long()], table[(codes >> 4).long()]], dim=-1).flatten(-2)
    exponents = scales.to(torch.int32) - SCALE_BIAS
    return torch.ldexp(values, exponents.unsqueeze(-1)).flatten(-2).to(dtype)


# As a weight map row's ``packed`` (``models/common/weight_map.py``): ``<name>_blocks`` and ``<name>_scales``.
MXFP4 = PackedFormat(suffixes=("_blocks", "_scales"), values_per_group=32, dequantize=dequantize_mxfp4)
