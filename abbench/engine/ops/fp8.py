"""Float8 e4m3 with one float32 scale per row: the rule every FP8 path of the engine shares.

- ``quantize_rows(w [..., R, C])`` -> (q [..., R, C] float8 e4m3, scale [..., R] float32): the scale is the row's
  largest magnitude / 448 (e4m3's largest finite value; 1 for an all-zero row), the values are w / scale rounded
  to nearest. The host bank quantizes experts with it (``models.bank``), W8A8's activations follow it
  (``moe.w8a8_reference``; ``kernels.quantize_rows_fp8`` gives its bits in one Triton kernel).
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [..., R, C] in any float dtype as float8 e4m3 with one float32 scale per row (the last dimension's
    largest magnitude / 448; 1 for an all-zero row): (q [..., R, C], scale [..., R]), on ``w``'s device."""
    w32 = w.to(torch.float32)
    amax = w32.abs().amax(dim=-1)
    # a tensor divisor, not the number: CUDA divides by a number as a multiplication by its reciprocal (another
    # rounding than the CPU's division), so the same weights would quantize differently on the two devices
    scale = amax / torch.full_like(amax, FP8_MAX)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (w32 / scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale
