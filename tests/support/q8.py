"""What the native int8 product computes (``daemon/model/gemv.c``), in float64 from its definition: each input row
quantized in blocks of 64 values to round(x / d), d = max|x| / 127 (float32 arithmetic, ties to even, as the C
does), then the exact sum over blocks of d times the block's integer dot product, times the row's scale."""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 64


def quantized_rows(x: torch.Tensor) -> torch.Tensor:
    """``x [..., n]`` (float32 or bfloat16) as the product sees it: each block's integers times its d, in float64."""
    rows = x.float().reshape(-1, x.shape[-1])
    out = torch.empty(rows.shape, dtype=torch.float64)
    for start in range(0, rows.shape[-1], BLOCK):
        block = rows[:, start:start + BLOCK]
        d = block.abs().amax(dim=-1, keepdim=True) / 127
        inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        out[:, start:start + BLOCK] = torch.round(block * inverse).double() * d.double()
    return out.reshape(x.shape)


def int8_product(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """``x`` by int8 ``weight [out, in]`` with a bfloat16 ``scale`` per row, as the native kernel defines it."""
    weights = weight.double() * scale.double()[:, None]
    return F.linear(quantized_rows(x), weights, bias.double() if bias is not None else None)
