"""FP4 (E2M1) weights: MXFP4 as gpt-oss ships it, and compressed-tensors' nvfp4- and
mxfp4-pack-quantized, read exactly into QuantizedWeight's FP4 layout (bits 1: the packed
nibbles as they are, a float32 scale per group; kernels/quant_weight.py).

  mxfp4 (gpt-oss)  `<proj>_blocks` uint8 [..., N, K / 32, 16]: two E2M1 values a byte, column
                   2j in the low nibble, 2j + 1 in the high one; `<proj>_scales` uint8
                   [..., N, K / 32]: E8M0, the scale 2^(e - 127) of each 32 columns. A leading
                   expert dim (gpt-oss: [E, 2 * I, H / 32, 16]) gives one weight per expert.
  nvfp4-pack-quantized  weight_packed uint8 [N, K / 2] (the same nibbles), weight_scale
                   float8_e4m3fn [N, K / 16], weight_global_scale float32 [1]:
                   w = e2m1 * (weight_scale / weight_global_scale)
  mxfp4-pack-quantized  weight_packed as nvfp4, weight_scale uint8 E8M0 [N, K / 32]

Exact: an E2M1 value has two significant bits and an E8M0 scale is a power of two, exact in
float32 (2^-127 as a subnormal; 255, E8M0's NaN, is refused: no release holds one), so the
float32 product value * scale is transformers' convert_moe_packed_tensors (lut value ldexp'd
by e - 127), bit for bit; NVFP4's scale is fp8_scale / global_scale rounded once in float32,
as compressed-tensors' own dequantize computes it, times the value. The nibbles stay packed:
half a byte a value plus a float32 scale per group, as in the checkpoint (whose scales are one
byte: 0.625 bytes a value here against its 0.53)."""

from __future__ import annotations

import torch

from splitserve.kernels.quant_weight import FP4, QuantizedWeight


def e8m0_scales(exponents: torch.Tensor, name: str) -> torch.Tensor:
    """uint8 E8M0 -> float32 2^(e - 127), built from its bits: e << 23 for e >= 1, the
    subnormal 2^-127 for e = 0; 255 (NaN in the OCP MX spec) is refused."""
    e = exponents.to(torch.int32)
    if (e == 255).any():
        raise ValueError(f"{name}: an E8M0 scale is 255, which is NaN in the MX spec")
    bits = torch.where(e == 0, torch.full_like(e, 1 << 22), e << 23)
    return bits.view(torch.float32)


def _fp4_weight(packed: torch.Tensor, scales: torch.Tensor) -> QuantizedWeight:
    n, k = packed.shape[0], 2 * packed.shape[1]
    return QuantizedWeight(codes=packed.contiguous(), scales=scales.contiguous(), offsets=None, bits=FP4,
                           group_size=k // scales.shape[1], in_features=k, out_features=n)


def mxfp4_weights(blocks: torch.Tensor, scales: torch.Tensor, name: str) -> list[QuantizedWeight]:
    """gpt-oss's `_blocks` / `_scales` -> one QuantizedWeight per leading index (expert); a
    2-D weight ([N, K / 32, 16]) gives a list of one."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() < 3 or blocks.shape[-1] != 16 \
            or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"{name}: mxfp4 blocks {blocks.dtype} {tuple(blocks.shape)} and scales {scales.dtype} "
                         f"{tuple(scales.shape)} do not fit [..., N, K / 32, 16] and [..., N, K / 32] uint8")
    n, groups = scales.shape[-2:]
    return [_fp4_weight(b, e8m0_scales(s, name))
            for b, s in zip(blocks.reshape(-1, n, groups * 16), scales.reshape(-1, n, groups), strict=True)]


def nvfp4_weight(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None,
                 name: str) -> QuantizedWeight:
    """compressed-tensors fp4 packing: nvfp4 (fp8 scales over a global scale) or, with a uint8
    scale and no global one, mxfp4 (E8M0 scales)."""
    if packed.dtype != torch.uint8 or packed.dim() != 2 or scale.dim() != 2 or scale.shape[0] != packed.shape[0] \
            or (2 * packed.shape[1]) % scale.shape[1]:
        raise ValueError(f"{name}: weight_packed {packed.dtype} {tuple(packed.shape)} and weight_scale "
                         f"{tuple(scale.shape)} do not fit uint8 [N, K / 2] and [N, K / group]")
    if scale.dtype == torch.uint8 and global_scale is None:
        return _fp4_weight(packed, e8m0_scales(scale, name))
    if scale.dtype != torch.float8_e4m3fn or global_scale is None or global_scale.numel() != 1:
        raise ValueError(f"{name}: nvfp4 needs a float8_e4m3fn weight_scale and one weight_global_scale, got "
                         f"{scale.dtype} and {None if global_scale is None else tuple(global_scale.shape)}")
    # compressed-tensors' _dequantize: scale / global_scale, in float32, rounded once
    return _fp4_weight(packed, scale.float() / global_scale.float().reshape(1, 1))
