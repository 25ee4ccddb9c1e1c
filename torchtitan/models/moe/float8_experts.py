"""FP8 grouped GEMMs for routed experts (CUDA, SM 8.9+): torchao's rowwise-scaled ``torch._scaled_grouped_mm``.

``GroupedExperts.to_float8`` (``models/moe/experts.py``), which the Float8 converter
(``torchtitan/quantization/float8.py``) calls, switches a module's grouped products to ``fp8_grouped_mm``
where ``fp8_grouped_mm_runs``; the parameters and the state dict stay as they are. Imports go one way:
``experts.py`` imports this module, which knows nothing of the experts.

The FP8 grouped GEMM takes groups whose row counts are multiples of 16. Routed tokens come in any
counts, so each expert's rows are copied into a buffer where its group starts at a multiple of 16
(at most 15 padding rows per expert, a static bound: no host sync), multiplied, and read back.
Where the op cannot run (other devices, emulation, widths not multiples of 16, no token)
``fp8_grouped_mm`` returns None and the high-precision grouped product of ``experts.py`` runs instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from torchtitan import compat

ALIGN = 16  # rows per group that the FP8 grouped GEMM takes

# (x [M, K], weight transposed [G, K, N], group end offsets int32 [G]) -> [M, N]
GroupedMM = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def fp8_grouped_mm_runs(device_type: str, emulate: bool) -> bool:
    """Whether routed experts can take FP8 grouped GEMMs here."""
    return compat.fp8_grouped_mm_skip_reason(device_type, emulate) is None


def aligned_rows(counts: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where each of ``rows`` grouped rows goes when every group starts at a multiple of ``ALIGN``.

    Returns ``(destination row of each row, group end offsets int32, buffer rows)``; computed on the
    device (``rows`` is known on the host), so the counts are never read back.
    """
    padded = (counts + ALIGN - 1) // ALIGN * ALIGN
    ends = torch.cumsum(padded, dim=0)
    group = torch.repeat_interleave(torch.arange(counts.shape[0], device=counts.device), counts, output_size=rows)
    first_of_group = torch.cumsum(counts, dim=0) - counts
    destination = (ends - padded)[group] + torch.arange(rows, device=counts.device) - first_of_group[group]
    # The buffer's row count is a multiple of ALIGN too: the weight gradient reads the buffer transposed,
    # and the FP8 kernel needs every stride to be a multiple of 16 bytes (one byte per FP8 element).
    worst = rows + (ALIGN - 1) * counts.shape[0]
    capacity = (worst + ALIGN - 1) // ALIGN * ALIGN
    return destination, ends.to(torch.int32), capacity


def padded_grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, mm: GroupedMM) -> torch.Tensor:
    """``x [M, K]`` (``counts[g]`` rows per group) times ``weight[g].T`` (``weight [G, N, K]``) through ``mm``,
    every group padded to a multiple of ``ALIGN`` rows (zeros, dropped again from the result)."""
    destination, offsets, capacity = aligned_rows(counts, x.shape[0])
    buffer = x.new_zeros(capacity, x.shape[1]).index_copy(0, destination, x)
    return mm(buffer, weight.transpose(-2, -1), offsets).index_select(0, destination)


def _fp8_rowwise_grouped_mm(x: torch.Tensor, weight_t: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm

    return _to_fp8_rowwise_then_scaled_grouped_mm(x, weight_t, offsets, out_dtype=x.dtype,
                                                  pad_token_groups_for_grouped_mm=False)


def fp8_grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor | None:
    """``x [M, K]`` (``counts[g]`` rows per group) times ``weight[g].T`` as an FP8 grouped GEMM; None where it
    does not fit (not CUDA, another dtype, no row, widths not multiples of ``ALIGN``)."""
    fits = (x.is_cuda and x.dtype in (torch.bfloat16, torch.float32) and x.shape[0] > 0
            and weight.shape[-1] % ALIGN == 0 and weight.shape[-2] % ALIGN == 0)
    return padded_grouped_mm(x, weight, counts, _fp8_rowwise_grouped_mm) if fits else None
