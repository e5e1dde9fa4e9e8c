"""FP4 (E2M1) weights: MXFP4 as gpt-oss ships it, and compressed-tensors' nvfp4- and
mxfp4-pack-quantized, converted exactly into QuantizedWeight's FP8-code layout.

  mxfp4 (gpt-oss)  `<proj>_blocks` uint8 [..., N, K / 32, 16]: two E2M1 values a byte, column
                   2j in the low nibble, 2j + 1 in the high one; `<proj>_scales` uint8
                   [..., N, K / 32]: E8M0, the scale 2^(e - 127) of each 32 columns. A leading
                   expert dim (gpt-oss: [E, 2 * I, H / 32, 16]) gives one weight per expert.
  nvfp4-pack-quantized  weight_packed uint8 [N, K / 2] (the same nibbles), weight_scale
                   float8_e4m3fn [N, K / 16], weight_global_scale float32 [1]:
                   w = e2m1 * (weight_scale / weight_global_scale)
  mxfp4-pack-quantized  weight_packed as nvfp4, weight_scale uint8 E8M0 [N, K / 32]

Why FP8 codes (bits 0): every E2M1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives)
is a float8_e4m3fn value, and an E8M0 scale is a power of two, exact in float32 (2^-127 as a
subnormal; 255, E8M0's NaN, is refused: no release holds one).
So code * scale is each format's own dequantisation, bit for bit: transformers'
convert_moe_packed_tensors (lut value ldexp'd by e - 127) and compressed-tensors' dequantize
(scale / global_scale rounded once in float32, then times the value). The FP4 values are
not affine in their 4-bit code, so QuantizedWeight's 4-bit integer layout cannot hold them:
the price is one byte a value in memory instead of the checkpoint's half byte (see
docs/architecture.md "Quantized checkpoints" for what that costs and what it measured)."""

from __future__ import annotations

import torch

from splitserve.kernels.quant_weight import FP8, QuantizedWeight

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# nibble -> the float8_e4m3fn byte of the same value (exact: checked at import)
_FP8_BYTES = torch.tensor(E2M1).to(torch.float8_e4m3fn).view(torch.uint8)
assert torch.equal(_FP8_BYTES.view(torch.float8_e4m3fn).float(), torch.tensor(E2M1))
_BYTE_PAIRS = torch.stack([_FP8_BYTES[torch.arange(256) & 0xF], _FP8_BYTES[torch.arange(256) >> 4]], dim=1)


def fp4_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K / 2] packed E2M1 nibbles (low nibble first) -> float8_e4m3fn [..., K]: one
    lookup per packed byte (its two FP8 bytes)."""
    return _BYTE_PAIRS[packed.long()].flatten(-2).view(torch.float8_e4m3fn)


def e8m0_scales(exponents: torch.Tensor, name: str) -> torch.Tensor:
    """uint8 E8M0 -> float32 2^(e - 127), built from its bits: e << 23 for e >= 1, the
    subnormal 2^-127 for e = 0; 255 (NaN in the OCP MX spec) is refused."""
    e = exponents.to(torch.int32)
    if (e == 255).any():
        raise ValueError(f"{name}: an E8M0 scale is 255, which is NaN in the MX spec")
    bits = torch.where(e == 0, torch.full_like(e, 1 << 22), e << 23)
    return bits.view(torch.float32)


def _fp8_weight(codes: torch.Tensor, scales: torch.Tensor) -> QuantizedWeight:
    n, k = codes.shape
    return QuantizedWeight(codes=codes.contiguous(), scales=scales.contiguous(), offsets=None, bits=FP8,
                           group_size=k // scales.shape[1], in_features=k, out_features=n)


def mxfp4_weights(blocks: torch.Tensor, scales: torch.Tensor, name: str) -> list[QuantizedWeight]:
    """gpt-oss's `_blocks` / `_scales` -> one QuantizedWeight per leading index (expert); a
    2-D weight ([N, K / 32, 16]) gives a list of one."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() < 3 or blocks.shape[-1] != 16 \
            or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"{name}: mxfp4 blocks {blocks.dtype} {tuple(blocks.shape)} and scales {scales.dtype} "
                         f"{tuple(scales.shape)} do not fit [..., N, K / 32, 16] and [..., N, K / 32] uint8")
    n, groups = scales.shape[-2:]
    # an expert at a time: the lookup's int64 indices cost 8 bytes a packed byte
    return [_fp8_weight(fp4_codes(b), e8m0_scales(s, name))
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
        return _fp8_weight(fp4_codes(packed), e8m0_scales(scale, name))
    if scale.dtype != torch.float8_e4m3fn or global_scale is None or global_scale.numel() != 1:
        raise ValueError(f"{name}: nvfp4 needs a float8_e4m3fn weight_scale and one weight_global_scale, got "
                         f"{scale.dtype} and {None if global_scale is None else tuple(global_scale.shape)}")
    # compressed-tensors' _dequantize: scale / global_scale, in float32, rounded once
    return _fp8_weight(fp4_codes(packed), scale.float() / global_scale.float().reshape(1, 1))
