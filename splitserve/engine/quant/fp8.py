"""FP8 weights: float8_e4m3fn codes times a float32 scale per tensor, per output row, or per
block of rows x columns (`quant_method: fp8` with `weight_block_size`, as Qwen3-FP8 and
DeepSeek ship, whose `weight_scale_inv` despite its name multiplies; compressed-tensors'
float-quantized `weight_scale`). Converted exactly: scale blocks become groups of
gcd(block columns, in_features) columns, so rows and columns need not be multiples of 128."""

from __future__ import annotations

import math

import torch

from splitserve.kernels.quant_weight import FP8, QuantizedWeight


def fp8_weight(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, name: str) -> QuantizedWeight:
    """`scale`: one value (per tensor), [N, 1] (per row) or, with `block` (rows, cols),
    [ceil(N / rows), ceil(K / cols)]."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D float8_e4m3fn weight, got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    scale = scale.float()
    if block is None:
        if scale.numel() == 1:
            scales = scale.reshape(1, 1).expand(n, 1)
        elif scale.numel() == n:
            scales = scale.reshape(n, 1)
        else:
            raise ValueError(f"{name}: weight_scale has shape {tuple(scale.shape)}; expected one value or {n}")
        group = k
    else:
        rows, cols = block
        want = (math.ceil(n / rows), math.ceil(k / cols))
        if tuple(scale.shape) != want:
            raise ValueError(f"{name}: scale has shape {tuple(scale.shape)}; blocks of {rows}x{cols} over a "
                             f"{n}x{k} weight need {want}")
        group = math.gcd(cols, k)
        col_block = torch.arange(0, k, group) // cols  # the scale column of each group
        scales = scale[torch.arange(n) // rows][:, col_block]
    return QuantizedWeight(codes=weight.contiguous(), scales=scales.contiguous(), offsets=None, bits=FP8,
                           group_size=group, in_features=k, out_features=n)
